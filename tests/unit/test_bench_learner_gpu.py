"""The GPU learner benchmark's contract where CUDA is absent: one last line `SKIP: <reason>`, exit 3,
no results written (make gpu-check relies on it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the benchmark would run")
def test_without_cuda_it_skips_with_exit_3(tmp_path):
    out = "gpu/contract-check-learner"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_learner.py"), "--device", "cuda", "--out", out, "--dry-run"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("SKIP: ")
    assert not (REPO / "benchmarks" / "results" / f"{out}.json").exists()
