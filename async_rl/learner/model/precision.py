"""`learner.mixed_precision=bf16_params`: a bf16 working copy of the model that the forward and backward
run on, beside the fp32 master weights that the optimizer owns.

Autocast over fp32 weights re-casts every weight at every use, so once per micro-batch in the forward
and again for the backward (on the first H100 measurement: 20,503 `copy_` calls a step, 17% of CUDA
time), and it keeps the residual stream, RMSNorm and RoPE in fp32. Here the weights are cast once per
optimizer step (`refresh`, after the step or a load), the model then computes in bf16 throughout (its
residual stream too, as the models were trained), and every parameter gradient is accumulated into the
master's fp32 `.grad` as soon as autograd has it (a post-accumulate-grad hook: one mixed-dtype add,
no separate cast, no bf16 accumulation across micro-batches). Gradient clipping, the reduction over
data-parallel ranks and AdamW then see fp32 gradients of the fp32 masters, as before.

This is what FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` does for sharded
parameters; the torch backend keeps FSDP2's policy for `parallel=fsdp2` and uses this copy for one rank
and DDP, which have no such policy.
"""

from __future__ import annotations

import copy
from functools import partial

import torch
import torch.distributed as dist

# Gradient all-reduce bucket (elements): a flat fp32 buffer of at most this size exists at a time.
REDUCE_BUCKET = 1 << 25


class WorkingCopy:
    """A `dtype` copy of `master` (the same module tree, parameters cast, buffers shared as they are: HF
    keeps RoPE's inverse frequencies in fp32 on purpose). `module` is what the forward runs on."""

    def __init__(self, master: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
        self.master = master
        # deepcopy with the parameters pre-mapped: the fp32 tree is never duplicated in fp32, tied
        # parameters stay tied (one id, one entry), and every other attribute is copied as deepcopy does.
        memo: dict[int, object] = {}
        for p in master.parameters():
            memo[id(p)] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
        for b in master.buffers():
            memo[id(b)] = b
        self.module: torch.nn.Module = copy.deepcopy(master, memo)
        self._pairs = list(zip(master.parameters(), self.module.parameters(), strict=True))
        for m, w in self._pairs:
            if w.requires_grad:
                w.register_post_accumulate_grad_hook(partial(_accumulate_into, m))
        self.stale = False
        self.refreshes = 0  # weight casts of the whole model so far (tests count them)

    def mark_stale(self) -> None:
        """The masters changed (an optimizer step, a checkpoint load): the next forward re-casts."""
        self.stale = True

    def refresh_if_stale(self) -> None:
        if not self.stale:
            return
        with torch.no_grad():
            torch._foreach_copy_([w for _, w in self._pairs], [m for m, _ in self._pairs])
        self.stale = False
        self.refreshes += 1


def _accumulate_into(master: torch.nn.Parameter, working: torch.nn.Parameter) -> None:
    """Move a working parameter's fresh gradient into its master's fp32 gradient."""
    if master.grad is None:
        master.grad = working.grad.to(master.dtype)
    else:
        master.grad.add_(working.grad)  # mixed dtypes in one kernel: no bf16 accumulation
    working.grad = None


def all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum the fp32 gradients of `params` over the default group, in flat buckets of REDUCE_BUCKET
    elements (what DDP does during backward, done once after the last micro-batch instead: the working
    copy's gradients land in the masters, which DDP does not see)."""
    grads = [p.grad for p in params if p.grad is not None]
    bucket: list[torch.Tensor] = []
    size = 0
    for g in [*grads, None]:
        if g is not None and (not bucket or size + g.numel() <= REDUCE_BUCKET):
            bucket.append(g)
            size += g.numel()
            continue
        if bucket:
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.all_reduce(flat)
            torch._foreach_copy_(bucket, [c.view_as(t) for c, t in zip(flat.split([t.numel() for t in bucket]),
                                                                        bucket, strict=True)])
        bucket, size = ([g], g.numel()) if g is not None else ([], 0)
