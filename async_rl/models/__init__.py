"""Model presets and resolution of `model.path`."""
