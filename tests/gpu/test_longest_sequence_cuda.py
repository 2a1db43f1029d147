"""On CUDA: `bench_learner.py --longest`'s search on a real out-of-memory. The allocator is
capped a little above what this process holds, so the tiny shape runs out of memory within 16k tokens;
the search must catch torch.OutOfMemoryError and free what the failed step held before the next try
(marked gpu; skipped without CUDA)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import longest_sequence as ls  # noqa: E402

CAP = 160 * 2**20  # what the search may add to this process's reserved memory


def test_the_search_recovers_from_a_real_out_of_memory(tmp_path):
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = (torch.cuda.memory_reserved() + CAP) / total
    a = argparse.Namespace(device="cuda", shape="tiny", checkpointing="off", model_dir=str(tmp_path / "tiny"),
                           start=2048, resolution=1024, max_length=16384, time_cap_s=60.0, memory_fraction=fraction,
                           fake_budget_mib=0.0)
    try:
        tries: list[dict] = []
        result = ls.measure_setting(a, report=tries.append)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    print({k: v for k, v in result.items() if k != "tries"}, [(t["length"], t["fits"]) for t in tries])
    assert result["working_copy"] and result["attention"] == "varlen"  # the GPU recipes' path
    failed = [t for t in tries if not t["fits"]]
    assert failed and all("out of memory" in t["error"].lower() for t in failed)
    # every try after the warm-up starts from the same memory: a failed one left nothing behind
    held = [t["held_bytes"] for t in tries[1:]]
    assert max(held) - min(held) < 2**20, held
    assert result["longest"] >= 2048 and result["stopped"] in ("resolution", "max length")
    assert result["peak_bytes"] <= total * fraction and result["step_s"] > 0
