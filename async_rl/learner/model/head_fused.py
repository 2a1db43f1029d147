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
compares them, values and gradients, eager and compiled on the CPU). Only the chunk's length is
dynamic (`_one_compile`): the last, shorter chunk and the next micro-batch's chunk count do not
recompile, and the vocabulary (fixed for a run) stays a constant the compiler can tile for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Literal

import torch

# The torch head's `fused` argument, what `fused_setting` makes of learner.head_kernel: False (eager),
# True (compiled) or "triton" (`head_triton`'s forward statistics, the compiled backward).
FusedPath = bool | Literal["triton"]


def kernel_name(setting: str, device_type: str) -> str:
    """`learner.head_kernel` as a kernel's name (eager, compiled or triton) where nothing is measured:
    auto is compiled on CUDA, eager elsewhere (the backends measure auto on CUDA where they can: `head_probe`)."""
    if setting == "auto":
        return "compiled" if device_type == "cuda" else "eager"
    return setting


def fused_setting(setting: str, device_type: str) -> FusedPath:
    """`learner.head_kernel` on this device as the torch head's `fused` argument: False (eager), True
    (compiled) or "triton" (`head_triton`'s forward statistics, the compiled backward). Raises a
    RunError where triton is asked for and cannot run."""
    if setting == "triton":
        from async_rl.learner.model import head_triton

        head_triton.check(device_type)
        return "triton"
    return kernel_name(setting, device_type) == "compiled"


def kernels(fused: FusedPath) -> HeadKernels:
    """The per-chunk functions of the fused path `fused` (True: `compiled()`; "triton": the same with
    `head_triton.chunk_stats` for the forward statistics)."""
    if fused == "triton":
        from async_rl.learner.model import head_triton

        return dataclasses.replace(compiled(), stats=head_triton.chunk_stats)
    return compiled()


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
    where `grad_entropy` is given): d log p(y)/dz = (onehot(y) - p) / t, dH/dz = -p (log p + H) / t. For
    one vocabulary shard (Megatron, TP > 1) z is the shard's logits and `targets` are shifted by its
    first id: a target outside the shard matches no column, so its one-hot is 0 here."""
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


def scaled_logits_(z: torch.Tensor, temperature: float, kept: bool) -> torch.Tensor:
    """fp32 logits / temperature of one chunk's compute-dtype logits `z`, for the eager loops to change in
    place: a new tensor in bf16 or fp16; in fp32 `z` itself, divided in place, or a copy where `z` is
    `kept` from the forward for the backward (learner.logprob_keep_logits: a second backward reads it)."""
    zf = z.float()
    if kept and zf is z:
        zf = zf.clone()
    return zf.div_(temperature) if temperature != 1.0 else zf


def eager_chunk_grad_(
    logp_all: torch.Tensor,
    entropy: torch.Tensor | None,
    local_targets: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """`chunk_grad` for the eager loops, written in place: `logp_all` is the chunk's fp32 log p over one
    vocabulary shard [c, V'] (the whole vocabulary for the torch head), and is overwritten. One fp32
    [c x V'] tensor without the entropy's gradient, two with it (`chunk_grad`, written out of place for
    the compiler, would make several). `local_targets` are the targets less the shard's first id; a
    target outside [0, V') gets no one-hot here (Megatron: another rank's rows hold it)."""
    if grad_entropy is None:
        dz = logp_all.exp_()  # p
    else:
        assert entropy is not None
        # H = -sum p log p: dH / dz_j = -p_j (log p_j + H)
        p = torch.exp(logp_all)
        dz = logp_all.add_(entropy[:, None]).mul_(p).mul_(-grad_entropy.float()[:, None])
    if grad_logp is not None:
        # d log p(y) / dz = onehot(y) - p
        g = grad_logp.float()
        if grad_entropy is None:
            dz.mul_(-g[:, None])
        else:
            dz.sub_(p.mul_(g[:, None]))
        rows = dz.shape[-1]
        if rows:
            mine = (local_targets >= 0) & (local_targets < rows)
            dz.scatter_add_(1, local_targets.clamp(0, rows - 1)[:, None], (g * mine)[:, None])
    if grad_entropy is not None:
        del p
    if temperature != 1.0:
        dz.div_(temperature)
    return dz.to(dtype)


def shard_max(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 [c]: the largest logit / temperature of each row of one vocabulary shard's logits [c, V/tp]
    (the Megatron head all-reduces it over TP ranks before `shard_sums`)."""
    return (z.float() / temperature).amax(dim=-1)


def shard_sums(
    z: torch.Tensor, top: torch.Tensor, local_targets: torch.Tensor, temperature: float, with_entropy: bool
) -> torch.Tensor:
    """fp32 [3, c] over one vocabulary shard's logits z [c, V/tp], shifted by the global max `top`:
    sum exp(z - top), sum exp(z - top) z (0 without the entropy), and the target's z where this shard
    holds it (`local_targets` = targets - the shard's first id; 0 elsewhere). Summed over TP ranks,
    they give the log-sum-exp, the entropy and log p(target) (megatron/head.py)."""
    zf = z.float() / temperature
    e = torch.exp(zf - top[:, None])
    rows = z.shape[-1]
    mine = (local_targets >= 0) & (local_targets < rows)
    target = torch.where(mine, zf.gather(-1, local_targets.clamp(0, rows - 1)[:, None]).squeeze(-1), 0.0)
    weighted = (e * zf).sum(-1) if with_entropy else torch.zeros_like(target)
    return torch.stack([e.sum(-1), weighted, target])


@dataclass(frozen=True)
class HeadKernels:
    """The per-chunk functions, compiled or as written."""

    stats: Callable
    grad: Callable
    shard_max: Callable
    shard_sums: Callable


EAGER = HeadKernels(chunk_stats, chunk_grad, shard_max, shard_sums)


def _one_compile(f: Callable) -> Callable:
    """`f` compiled once for every chunk length. Every tensor argument's first dimension is the chunk's
    rows, marked dynamic; the other dimensions (the vocabulary) stay static. The small per-chunk vectors
    reach here as slices of the micro-batch's (targets, log-sum-exp, gradients): dynamo guards a view
    on its base's sizes too, and where one chunk covered a whole micro-batch, duck sizing tied the base's
    length to the chunk's, so the next micro-batch with more chunks compiled everything again (seen on
    an H200, 2026-11-27). They are passed as tensors of their own (a copy of [chunk] numbers)."""
    compiled_f = torch.compile(f)

    def call(*args):
        own = []
        for a in args:
            if isinstance(a, torch.Tensor):
                if a._base is not None:
                    a = a.clone()
                torch._dynamo.maybe_mark_dynamic(a, 0)
            own.append(a)
        return compiled_f(*own)

    return call


@cache
def compiled() -> HeadKernels:
    """The functions compiled (one process-wide compile each, guarded on the arguments' kinds: with or
    without entropy, with or without each gradient)."""
    return HeadKernels(*(_one_compile(f) for f in (chunk_stats, chunk_grad, shard_max, shard_sums)))
