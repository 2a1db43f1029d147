"""The pure parts of benchmarks/bench_sim.py: length tails, the decode-cost model, the GPU split."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from sim_model import Gpu, Lengths, Model, decode_step_s, decode_tokens_per_s, nearby_splits, split_gpus  # noqa: E402


def test_default_lengths_are_long_tailed_and_capped():
    lengths = Lengths()
    x = lengths.sample(np.random.default_rng(0), 100_000)
    p50, p99 = np.percentile(x, [50, 99])
    assert p99 / p50 >= 10  # the regime published async systems win in
    assert x.max() == lengths.cap and x.min() >= 1
    assert abs(p50 - lengths.median) / lengths.median < 0.05


def test_decode_step_is_memory_bound_at_small_batch_and_grows_with_batch_and_context():
    gpu, model = Gpu(), Model()
    one = decode_step_s(1, 1000, gpu, model)
    # batch 1 reads the weights once per step: within the CPU overhead of the HBM roofline
    roofline = model.weight_bytes / (gpu.hbm_bytes_s * gpu.mem_eff)
    assert one == pytest.approx(roofline + gpu.step_overhead_s, rel=0.05)
    assert decode_step_s(256, 256 * 1000) > decode_step_s(64, 64 * 1000) > one
    assert decode_step_s(64, 64 * 8000) > decode_step_s(64, 64 * 1000)  # KV reads cost time
    # batching amortizes the weight reads: far more tokens/s, but sub-linear
    assert 50 < decode_tokens_per_s(256, 1000) / decode_tokens_per_s(1, 1000) < 256
    assert decode_step_s(0, 0) == 0.0


def test_split_balances_generation_against_training():
    assert split_gpus(8, 3.0, 1.0) == (2, 6)  # 2 x 3 = 6 x 1
    assert split_gpus(128, 1.0, 1.0) == (64, 64)
    assert split_gpus(2, 100.0, 1.0) == (1, 1)  # at least one GPU each side
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        split_gpus(1, 1.0, 1.0)


def test_nearby_splits_stay_in_range_and_centre_on_the_balanced_one():
    assert nearby_splits(128, 40, 3) == [24, 40, 56]
    assert nearby_splits(8, 1, 3) == [1, 2, 3]
    assert all(1 <= g < 8 for g in nearby_splits(8, 7, 5))
    assert nearby_splits(16, 5, 1) == [5]
