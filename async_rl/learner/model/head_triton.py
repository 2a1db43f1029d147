"""The chunked head's forward statistics as one hand-written Triton kernel (`learner.head_kernel: triton`).

`head_fused.chunk_stats` compiled by inductor was the head's slowest kernel on an H200: 3.05 ms a call
for one chunk of 1,024 positions over Qwen2.5's 151,936-token vocabulary, 25% of the learner's CUDA
time, where reading the chunk's 311 MB of bf16 logits once takes ~0.07 ms at the GPU's memory bandwidth
(`benchmarks/results/gpu/2026-11-27d-h200.md`). This kernel reads each row once: an online softmax over
blocks of the vocabulary (a running max m, the running sums of exp(z/t - m) and of exp(z/t - m) (z/t - m),
both rescaled when m grows), the target's logit read once per row, fp32 arithmetic on bf16, fp16 or
fp32 logits. Its outputs are `head_fused.chunk_stats`'s (tests/unit/test_head_triton.py compares them,
on the CPU under Triton's interpreter); the backward stays `head_fused`'s compiled `chunk_grad`.

Its block size and warp count are not guessed: on CUDA Triton's autotuner times `CONFIGS` on the first
call for each vocabulary size and logits dtype and keeps the fastest (`tuned`). Under the interpreter
(the CPU tests) it runs one config, `BLOCK` and `NUM_WARPS`. `learner.head_kernel: auto` picks this
kernel where the start-up probe measures it fastest (`head_probe`). Triton is imported only when the
kernel is first built, so importing this module needs no Triton.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cache

import torch

from async_rl.errors import RunError

# (vocabulary elements per step of a program's loop, warps per program) tried by the autotuner on CUDA:
# small blocks keep more programs per SM, large ones more loads in flight and fewer block reductions
# (Liger's cross-entropy runs 32768 x 32 warps). One that does not fit the GPU's registers is dropped.
CONFIGS = ((2048, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16), (32768, 32))
# The one config under the interpreter; the tests set BLOCK small so that the loop runs several times
# with a partial last block.
BLOCK = 4096
NUM_WARPS = 8


def unavailable(device_type: str) -> str | None:
    """Why the kernel cannot run on `device_type` here (None when it can): it needs CUDA, or Triton's
    CPU interpreter (TRITON_INTERPRET=1, the tests), and an importable triton."""
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the Triton kernel needs CUDA (the device is {device_type}; TRITON_INTERPRET=1 runs it on the CPU, slowly)"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton does not import ({e})"
    return None


def check(device_type: str) -> None:
    """Raise a one-line RunError naming `learner.head_kernel` when the kernel cannot run here."""
    if why := unavailable(device_type):
        raise RunError(f"learner.head_kernel=triton: {why}; set learner.head_kernel to compiled or eager")


def build(autotuned: bool, do_bench: Callable | None = None) -> tuple[Callable, bool]:
    """(the kernel, `autotuned`), Triton imported here. Autotuned: over CONFIGS, keyed by the vocabulary
    size and WITH_ENTROPY (Triton's autotuner adds the logits' dtype), timed by `do_bench` (None:
    Triton's own, which needs a GPU; the tests pass a CPU timer under the interpreter). Else the one
    config BLOCK x NUM_WARPS, given at the launch."""
    import triton
    import triton.language as tl

    @triton.jit
    def stats_kernel(z_ptr, stride, targets_ptr, logp_ptr, lse_ptr, entropy_ptr, vocab, temperature,
                     WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = z_ptr + row * stride
        cols = tl.arange(0, BLOCK)
        inv_t = 1.0 / temperature
        # m: the row's running max of z/t (a scalar), the max of z divided by t: exactly the eager
        # code's max of z / t (division by t > 0 keeps the order), one division a block, not an
        # element. Per lane, the sums of e = exp(z/t - m) and of e (z/t - m).
        m = tl.full((), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK,), tl.float32)
        weighted = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, vocab, BLOCK):
            offs = start + cols
            inside = offs < vocab
            z = tl.load(row_ptr + offs, mask=inside, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, axis=0) / temperature)  # finite: a block holds a column at least
            x = z * inv_t
            scale = tl.exp(m - m_new)  # 0 on the first block (m = -inf)
            d = x - m_new
            e = tl.exp(d)  # 0 outside the vocabulary
            if WITH_ENTROPY:
                # the sum of e (z/t - m) moves to the new max: e' (z/t - m') = scale e ((z/t - m) + (m - m'))
                shift = tl.where(m == float("-inf"), 0.0, m - m_new)
                weighted = scale * (weighted + shift * total) + e * tl.where(inside, d, 0.0)
            total = total * scale + e
            m = m_new
        s = tl.sum(total, axis=0)
        log_s = tl.log(s)
        lse = m + log_s
        tl.store(lse_ptr + row, lse)
        y = tl.load(targets_ptr + row)
        ok = (y >= 0) & (y < vocab)  # a target off the vocabulary reads nothing and gives NaN
        z_y = tl.load(row_ptr + tl.where(ok, y, 0), mask=ok, other=float("nan")).to(tl.float32) / temperature
        tl.store(logp_ptr + row, z_y - lse)  # the eager code's rounding (and the backward's lse)
        if WITH_ENTROPY:
            # H = lse - E_p[z/t] = log s - E_p[z/t - m]
            tl.store(entropy_ptr + row, log_s - tl.sum(weighted, axis=0) / s)

    if not autotuned:
        return stats_kernel, False
    configs = [triton.Config({"BLOCK": block}, num_warps=warps) for block, warps in CONFIGS]
    # Every config writes the same outputs and reads nothing it writes: re-running one to time it is safe.
    return triton.autotune(configs, key=["vocab", "WITH_ENTROPY"], do_bench=do_bench)(stats_kernel), True


@cache
def _kernel() -> tuple[Callable, bool]:
    """The kernel, built on first use (TRITON_INTERPRET is read now): autotuned on CUDA, the one
    config under the interpreter (Triton's timer needs a GPU)."""
    return build(autotuned=os.environ.get("TRITON_INTERPRET") != "1")


def tuned() -> str | None:
    """The config the autotuner chose last ("BLOCK 8192, 16 warps"), None before a tuned call (or
    under the interpreter)."""
    if not _kernel.cache_info().currsize:  # not built: nothing ran (and triton stays unimported)
        return None
    kernel, autotuned = _kernel()
    best = getattr(kernel, "best_config", None) if autotuned else None
    return None if best is None else f"BLOCK {best.kwargs['BLOCK']}, {best.num_warps} warps"


def chunk_stats(
    z: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`head_fused.chunk_stats`: (log p(target), log-sum-exp, entropy or None), fp32 [c], of logits
    z [c, V] (bf16, fp16 or fp32) at `temperature`, one Triton program per row."""
    c, vocab = z.shape
    if z.stride(-1) != 1:
        z = z.contiguous()
    targets = targets.contiguous()
    logp = torch.empty(c, dtype=torch.float32, device=z.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if with_entropy else None
    if c:
        kernel, autotuned = _kernel()
        config = {} if autotuned else {"BLOCK": BLOCK, "num_warps": NUM_WARPS}
        kernel[(c,)](
            z, z.stride(0), targets, logp, lse, logp if entropy is None else entropy, vocab,
            float(temperature), WITH_ENTROPY=with_entropy, **config,
        )
    return logp, lse, entropy
