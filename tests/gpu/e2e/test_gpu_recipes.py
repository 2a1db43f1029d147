"""GPU tier, part B (needs vLLM and Ray besides part A's packages): every recipe under configs/gpu/
that this machine has the GPUs for runs 2 steps end to end through `python -m async_rl.launch`
(engines on GPUs, the weight sync the recipe resolves to, a mismatch probe after each sync).
Multi-node recipes (ray.address set) and recipes needing more GPUs than present are skipped with
the count; a machine without vLLM or Ray skips the whole part, naming the package."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="part B needs vLLM (pip install -e '.[gpu]'); part A runs without it")
pytest.importorskip("ray", reason="part B needs Ray (pip install -e '.[gpu]'); part A runs without it")

from async_rl.config import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
RECIPES = sorted((ROOT / "configs" / "gpu").glob("*.yaml"))
STEPS = 2
RUN_TIMEOUT_S = 1800


def gpus_needed(cfg) -> int:
    """Colocated: one engine and one learner rank per GPU; disaggregated: GPUs of their own."""
    engines = cfg.generators.num_engines * cfg.generators.tensor_parallel_size
    if cfg.placement == "colocated":
        return max(engines, cfg.learner.world_size)
    return engines + cfg.learner.world_size


def recipe_params():
    if not RECIPES:
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"no recipe under {ROOT / 'configs' / 'gpu'}"))]
    return [pytest.param(p, id=p.stem) for p in RECIPES]


@pytest.mark.parametrize("recipe", recipe_params())
def test_recipe_runs_two_steps(recipe: Path, tmp_path):
    cfg = load_config(str(recipe), [])
    if cfg.ray.address:
        pytest.skip(f"{recipe.name} is a multi-node recipe (ray.address={cfg.ray.address}): run it on its cluster")
    need, have = gpus_needed(cfg), torch.cuda.device_count()
    if need > have:
        pytest.skip(f"{recipe.name} needs {need} GPUs, this machine has {have}")
    overrides = [
        f"train.total_steps={STEPS}",
        "train.checkpoint_every=0",
        "train.checkpoint_at_end=false",
        f"logging.run_dir={tmp_path}",
        "logging.run_name=e2e",
        "logging.wandb.mode=disabled",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "async_rl.launch", str(recipe), *overrides],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
    assert proc.returncode == 0, f"{recipe.name} exited {proc.returncode}:\n{tail}"
    records = [json.loads(line) for line in (tmp_path / "e2e" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS)), tail
    assert all(math.isfinite(r["loss"]) for r in records), records
    synced = [r["logprob_mismatch"] for r in records if r.get("logprob_mismatch") is not None]
    assert synced, f"{recipe.name}: no step synced weights and probed the mismatch"
    # bf16 on both sides: the probe is a mean |vLLM - learner| log-prob; a broken sync is O(1)
    assert max(synced) < 0.1, f"{recipe.name}: log-prob mismatch {synced} after a sync"
