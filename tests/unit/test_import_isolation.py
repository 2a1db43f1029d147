"""Part A of the GPU tier runs on a box with torch, CuPy, transformers and megatron-core only (the
lent device's image: no Ray, no vLLM). In a subprocess whose import system refuses `ray` and `vllm`,
the learner driver, both backends, the weight-sync channels and the model presets import, and
`tests/gpu` part A collects without error."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MODULES = [
    "async_rl.learner.driver",
    "async_rl.learner.weight_source",
    "async_rl.learner.torch_backend",
    "async_rl.learner.megatron.backend",
    "async_rl.learner.megatron.learner",
    "async_rl.learner.megatron.model",
    "async_rl.weight_sync.transport",
    "async_rl.weight_sync.gloo",
    "async_rl.weight_sync.shm",
    "async_rl.weight_sync.cuda_ipc",
    "async_rl.weight_sync.nccl",
    "async_rl.models.tiny",
    "async_rl.models.smollm2",
    "async_rl.cluster.net",
]

PROBE = textwrap.dedent(
    """
    import importlib, importlib.abc, sys

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in ("ray", "vllm"):
                raise ModuleNotFoundError(f"{name} is refused here (a box without Ray and vLLM)")
            return None

    sys.meta_path.insert(0, Refuse())
    try:  # the hook works: the module that makes Ray actors does not import
        importlib.import_module("async_rl.cluster.resources")
    except ImportError as e:
        print("REFUSED:", e)
    for name in sys.argv[1:]:
        importlib.import_module(name)
        print("IMPORTED:", name)
    import pytest
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu and not gpu_e2e", "tests/gpu"])
    assert not [m for m in sys.modules if m.partition(".")[0] in ("ray", "vllm")]
    sys.exit(int(code))
    """
)


def test_learner_weight_sync_and_gpu_part_a_import_without_ray_and_vllm():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *MODULES], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "REFUSED: ray is refused here" in out, out[-2000:]
    assert [line.split()[1] for line in out.splitlines() if line.startswith("IMPORTED:")] == MODULES
    assert "error" not in out.lower().split("tests collected")[-1], out[-2000:]
    # Every part A module contributes tests, or skips whole with a reason naming what is missing
    # (here: CuPy, which the device image has).
    for module in sorted(p.name for p in (ROOT / "tests" / "gpu").glob("test_*.py")):
        skipped = [line for line in out.splitlines() if line.startswith("SKIPPED") and f"tests/gpu/{module}:" in line]
        assert f"tests/gpu/{module}::" in out or (skipped and "needs" in skipped[0]), f"{module}:\n{out[-3000:]}"
