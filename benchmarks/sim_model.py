"""The calibrated cost model behind `bench_sim.py`: pure functions, no sockets, no Ray.

Every constant here is either a published hardware figure or a published/measured efficiency, and
says where it comes from (the sources are listed in `bench_sim.py`'s docstring and in
benchmarks/README.md). Where no figure for exactly our setting was found we interpolate, and say so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Gpu:
    """One H100 SXM 80 GB."""

    hbm_bytes_s: float = 3.35e12  # NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3
    bf16_flops: float = 989e12  # NVIDIA H100 SXM datasheet: 989 TFLOPS dense BF16
    # Decode at batch 1 reaches ~77% of the HBM roofline with vLLM (Llama-3.1-8B on A100, vLLM 0.23,
    # johnmusgrave.com "vLLM throughput-latency sweep on NVIDIA A100"); we assume the same on H100.
    mem_eff: float = 0.77
    # Decode matmuls at large batch: assumed 50% of peak (not measured by a source we found).
    decode_compute_eff: float = 0.5
    # CPU-side scheduling/sampling per decode step that does not overlap the GPU (the vLLM v0.6.0
    # blog names it the main bottleneck before v0.6; after multi-step scheduling a few ms): assumed 2 ms.
    step_overhead_s: float = 0.002
    # Learner MFU: Megatron-LM's README reports up to 47% MFU on H100 clusters; a 7B model with
    # variable-length RL batches is below that: we take 40%.
    train_mfu: float = 0.40
    # Weight broadcast learner -> engines: NDR InfiniBand 400 Gb/s = 50 GB/s per GPU, ~80% for NCCL.
    sync_bytes_s: float = 40e9
    # Fixed cost of one weight sync besides the bytes (pause, bucket gather, resume): assumed 1 s.
    sync_fixed_s: float = 1.0


@dataclass(frozen=True)
class Model:
    """A 7B-class model: Qwen2.5-7B (7.6e9 parameters, 28 layers, 4 KV heads of dim 128, bf16)."""

    params: float = 7.6e9
    weight_bytes: float = 15.2e9  # bf16
    kv_bytes_per_token: float = 2 * 28 * 4 * 128 * 2  # K and V, 28 layers, 4 KV heads x 128, bf16
    # KV-cache room on one 80 GB GPU: 0.9 x 80 GB - weights - ~4 GB activations/graphs.
    kv_budget_bytes: float = 0.9 * 80e9 - 15.2e9 - 4e9
    # Learner FLOPs per token: 6N for forward + backward, 2N for recomputing old log-probs
    # (no reference model: GRPO/DAPO without a KL term).
    train_flops_per_param_token: float = 8.0

    @property
    def kv_budget_tokens(self) -> int:
        return int(self.kv_budget_bytes / self.kv_bytes_per_token)


def decode_step_s(batch: int, context_tokens: float, gpu: Gpu = Gpu(), model: Model = Model()) -> float:
    """Seconds for one decode step of `batch` sequences holding `context_tokens` KV entries in all:
    the slower of reading weights + KV cache from HBM and the matmul FLOPs, plus the CPU overhead."""
    if batch <= 0:
        return 0.0
    mem = (model.weight_bytes + context_tokens * model.kv_bytes_per_token) / (gpu.hbm_bytes_s * gpu.mem_eff)
    compute = 2 * model.params * batch / (gpu.bf16_flops * gpu.decode_compute_eff)
    return max(mem, compute) + gpu.step_overhead_s


def decode_tokens_per_s(batch: int, mean_context: float, gpu: Gpu = Gpu(), model: Model = Model()) -> float:
    return batch / decode_step_s(batch, batch * mean_context, gpu, model)


def train_tokens_per_s(gpu: Gpu = Gpu(), model: Model = Model()) -> float:
    """Learner tokens/s per GPU (prompt + completion tokens, forward + backward + old log-probs)."""
    return gpu.bf16_flops * gpu.train_mfu / (model.train_flops_per_param_token * model.params)


def sync_s(gpu: Gpu = Gpu(), model: Model = Model()) -> float:
    return gpu.sync_fixed_s + model.weight_bytes / gpu.sync_bytes_s


@dataclass(frozen=True)
class Lengths:
    """Completion lengths: lognormal with this median and log-sd, cut at `cap` (max_tokens)."""

    median: float = 600.0
    sigma: float = 1.0  # p99/median = exp(2.326 sigma) = 10.2 before the cap
    cap: int = 8192

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raw = rng.lognormal(math.log(self.median), self.sigma, n)
        return np.clip(np.rint(raw), 1, self.cap).astype(np.int64)

    def mean(self, rng: np.random.Generator | None = None) -> float:
        return float(self.sample(rng or np.random.default_rng(0), 200_000).mean())


def split_gpus(total: int, gen_tokens_s: float, train_tokens_s: float) -> tuple[int, int]:
    """Generation and training GPUs for a disaggregated run: the split whose two sides produce and
    consume tokens at the closest rates (at least one GPU each)."""
    if total < 2:
        raise ValueError(f"a disaggregated split needs at least 2 GPUs, got {total}")
    best = min(range(1, total), key=lambda g: abs(g * gen_tokens_s - (total - g) * train_tokens_s))
    return best, total - best


def nearby_splits(total: int, balanced: int, count: int) -> list[int]:
    """`count` generation-GPU counts around `balanced`, steps of total/8 (at least 1), in range."""
    step = max(1, total // 8)
    out = [balanced]
    k = 1
    while len(out) < count and k <= total:
        for g in (balanced - k * step, balanced + k * step):
            if 1 <= g < total and g not in out and len(out) < count:
                out.append(g)
        k += 1
    return sorted(out)
