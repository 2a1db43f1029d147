"""The real preset (smollm2-135m) under one controller for a test module: the model folder, the
config every real-model test shares, a local Ray whose workers see this checkout, and teardown in
the right order whatever the test's run raises."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import ray

from async_rl.cluster.placement import plan_placement
from async_rl.config import Config, WandbConfig, load_config
from async_rl.control.controller import Controller
from async_rl.control.metrics import MetricsSink
from tests import _presets
from tests._presets import model_cache
from tests.integration._engine_env import FAST_ENGINE_ENV

REPO = Path(__file__).resolve().parents[2]


def smollm2_dir() -> str:
    return str(_presets.smollm2_dir())


def real_config(overrides: list[str]) -> Config:
    """The real preset with no wandb, no final checkpoint and a quarter-GiB KV cache per engine (room
    for ~5,800 SmolLM2 tokens: every test's max_model_len x inflight sequences; the default GiB costs
    ~2 s of every engine start to allocate); `overrides` after (they win)."""
    return load_config(
        None,
        [
            "model.path=smollm2-135m",
            f"model.cache_dir={model_cache()}",
            "logging.wandb.mode=disabled",
            "train.checkpoint_at_end=false",
            "generators.kv_cache_gib=0.25",
            *overrides,
        ],
    )


@contextmanager
def real_controller(
    cfg: Config, run_dir: Path, env_vars: dict[str, str], model_dir: Path | None = None
) -> Iterator[tuple[Controller, MetricsSink]]:
    """A controller and a metrics sink on a fresh local Ray (4 CPUs) whose workers get `env_vars` and
    import this checkout; the controller, the sink and Ray are stopped on the way out. `model_dir`:
    the model's folder (default: the real preset's)."""
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=200 << 20, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO), **FAST_ENGINE_ENV, **env_vars}})
    controller = None
    sink = MetricsSink(run_dir, WandbConfig(mode="disabled"), {}, cfg.train.total_steps, stream=io.StringIO())
    try:
        controller = Controller(cfg, model_dir or Path(smollm2_dir()), run_dir, plan_placement(cfg))
        yield controller, sink
    finally:
        if controller is not None:
            controller.shutdown()
        sink.close()
        ray.shutdown()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
