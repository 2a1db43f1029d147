"""Generator pool: GeneratorEngine actors that own a vLLM AsyncLLM, the worker extension, rewards."""
