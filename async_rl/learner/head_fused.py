"""The chunked head's per-chunk softmax arithmetic as pure functions, compiled once per process on CUDA
(`learner.head_kernel`).

`head.ChunkedHead` gets a chunk's logits from a matmul in the compute dtype (bf16 on a GPU). Its eager
path then makes an fp32 copy of the [chunk x vocabulary] logits and several passes over it (max,
exp, sums, the gather; in backward: exp, the entropy and one-hot terms, the cast back): on an H200
with Qwen2.5's 151,936-token vocabulary that elementwise work took about 60% of the head's time, more
than its four matmuls (`benchmarks/results/gpu/2026-11-27c-h200.md`). Written as functions of the
bf16 logits, inductor fuses each into a few kernels that read the logits once or twice and write
only [chunk] statistics (forward) or the bf16 gradient (backward); no fp32 [chunk x vocabulary]
tensor is made.

Both functions are the same arithmetic as `ChunkedHead`'s eager loop (tests/unit/test_head_fused.py
compares them, values and gradients, eager and compiled on the CPU). They are compiled with
`dynamic=True`, so the last, shorter chunk and new vocabularies do not recompile per length.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch


def chunk_stats(
    z: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log p(target), log-sum-exp, entropy or None), fp32 [c], of logits z [c, V] (any float dtype)
    at `temperature`."""
    zf = z.float() / temperature
    top = zf.amax(dim=-1, keepdim=True)
    e = torch.exp(zf - top)
    total = e.sum(-1)
    lse = top.squeeze(-1) + torch.log(total)
    logp = zf.gather(-1, targets[:, None]).squeeze(-1) - lse
    entropy = lse - (e * zf).sum(-1) / total if with_entropy else None  # H = lse - E_p[z]
    return logp, lse, entropy


def chunk_grad(
    z: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    targets: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """d loss / d z [c, V] in `dtype`, from the chunk's logits z and its saved log-sum-exp (and entropy
    where `grad_entropy` is given): d log p(y)/dz = (onehot(y) - p) / t, dH/dz = -p (log p + H) / t."""
    logp_all = z.float() / temperature - lse[:, None]
    p = torch.exp(logp_all)
    dz = torch.zeros_like(p)
    if grad_entropy is not None:
        assert entropy is not None
        dz = dz - grad_entropy.float()[:, None] * p * (logp_all + entropy[:, None])
    if grad_logp is not None:
        vocab = torch.arange(z.shape[-1], device=z.device)
        onehot = (vocab[None, :] == targets[:, None]).float()
        dz = dz + grad_logp.float()[:, None] * (onehot - p)
    return (dz / temperature).to(dtype)


@cache
def compiled() -> tuple[Callable, Callable]:
    """(chunk_stats, chunk_grad) compiled (one process-wide compile each, guarded on the arguments'
    kinds: with or without entropy, with or without each gradient)."""
    return torch.compile(chunk_stats, dynamic=True), torch.compile(chunk_grad, dynamic=True)
