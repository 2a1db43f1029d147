"""The Megatron backend's output layer at the scored positions only, `chunk` positions at a time,
over a vocab-parallel weight (this TP rank's [V/tp, H] rows): log p(target) and, from the same
softmax, the entropy of the full next-token distribution.

`VocabParallelHead` is one autograd function over all chunks. Its forward keeps, per chunk, the fp32
logits and their exponentials (two fp32 [chunk x V/tp] tensors with the entropy, one without; the
compute-dtype matmul output is freed as soon as it is converted) and saves only vectors for backward: the log-sum-exp and the
entropy of each position. Its backward recomputes a chunk's logits; it works in one fp32
[chunk x V/tp] tensor when no loss uses the entropy (its gradient arrives as None: the entropy that
was only logged costs nothing in backward) and in two when one does (`algorithm.entropy_coef`).
With `keep_logits` (learner.logprob_keep_logits, as the torch head's `ChunkedHead`) the forward keeps
each chunk's compute-dtype logits for the backward instead: one GEMM a chunk fewer, for positions x
V/tp compute-dtype numbers held until the backward.

Across TP ranks: the max and the sums are all-reduced in forward (every rank runs the same chunks,
so the collectives line up); backward needs none (the saved log-sum-exp and entropy are global).
The gradient w.r.t. the hidden states is this rank's part of a sum over the vocabulary shards: the
caller passes the hidden states through megatron's `copy_to_tensor_model_parallel_region` (identity
forward, all-reduce backward), as megatron's ColumnParallelLinear does. Columns past the real
vocabulary (padding to a TP multiple) are left out of the matmul.

Pure torch (torch.distributed for TP > 1): no megatron import here, so the CPU tests measure it alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from async_rl.learner.model import head_fused


@dataclass(frozen=True)
class VocabShard:
    """Which rows of the (padded) output weight this TP rank holds, and its TP group."""

    start: int  # first vocabulary id of this rank's rows
    valid: int  # how many of its rows are real ids (the rest pad the vocabulary to a TP multiple)
    group: dist.ProcessGroup | None = None  # None: one TP rank, no collectives
    # the whole vocabulary on this rank (one TP rank, every target among its rows): the fused path then
    # runs the torch head's one-pass statistics (`head_fused.kernels(fused).stats`, Triton's too)
    whole: bool = False

    @classmethod
    def of(cls, vocab_size: int, rows: int, tp_rank: int, group: dist.ProcessGroup | None) -> VocabShard:
        start = tp_rank * rows
        return cls(start=start, valid=max(0, min(rows, vocab_size - start)), group=group,
                   whole=group is None and start == 0)


def _product(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One chunk's logits [c, valid] in the weight's dtype (the matmul there)."""
    return h.to(w.dtype) @ w.t()


def _shard_sums_eager(z: torch.Tensor, tc, shard: VocabShard, with_entropy: bool):
    """(the global max [c], this shard's sums [3, c]: `head_fused.shard_sums`'s) in torch ops over the
    chunk's fp32 logits / temperature `z` (`head_fused.scaled_logits_`, changed in place); the max is all-reduced here,
    the sums by the caller."""
    c = z.shape[0]
    m = z.max(dim=-1).values if shard.valid else torch.full((c,), float("-inf"), device=z.device)
    if shard.group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=shard.group)
    local = tc - shard.start
    mine = (local >= 0) & (local < shard.valid)
    sums = torch.zeros(3, c, dtype=torch.float32, device=z.device)
    if shard.valid:
        # the target's logit, on the rank whose rows hold it (0 elsewhere; summed over TP)
        at = local.clamp(0, shard.valid - 1)[:, None]
        sums[2] = torch.where(mine, z.gather(-1, at).squeeze(-1), 0.0)
    if with_entropy:
        e = (z - m[:, None]).exp_()  # fp32 tensor 2: the one softmax (unnormalised) both use
        sums[0] = e.sum(-1)
        sums[1] = e.mul_(z).sum(-1)  # sum_j e_j z_j, in place
        del e
    else:
        sums[0] = z.sub_(m[:, None]).exp_().sum(-1)  # in place: one fp32 tensor in all
    return m, sums


class VocabParallelHead(torch.autograd.Function):
    """(hidden [N, H], weight [V/tp, H], targets [N]) -> (log p(targets) [N], entropy [N]), fp32, at
    `temperature`; the entropy is computed only when `with_entropy` (else zeros, no pass over the
    vocabulary for it). Both outputs differentiable w.r.t. hidden and weight."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int, shard: VocabShard, with_entropy: bool,
                fused: head_fused.FusedPath = False, keep_logits: bool = False):
        n = hidden.shape[0]
        w = weight[: shard.valid]
        logp = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros_like(logp)
        lse = torch.empty_like(logp)
        kernels = head_fused.kernels(fused) if fused and shard.valid else None
        keep = keep_logits and shard.valid > 0 and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        kept = []  # one compute-dtype tensor a chunk, for the backward
        for s in range(0, n, chunk):
            h, tc = hidden[s : s + chunk], targets[s : s + chunk]
            c = h.shape[0]
            z = _product(h, w)
            if keep:
                kept.append(z)
            if kernels is not None:  # the compiled arithmetic reads the compute-dtype logits (head_fused)
                if shard.whole:  # one TP rank: the torch head's one-pass statistics
                    logp[s : s + c], lse[s : s + c], ent = kernels.stats(z, tc, temperature, with_entropy)
                    if with_entropy:
                        entropy[s : s + c] = ent
                    del z
                    continue
                m = kernels.shard_max(z, temperature)
                if shard.group is not None:
                    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=shard.group)
                sums = kernels.shard_sums(z, m, tc - shard.start, temperature, with_entropy)
                del z
            else:
                zf = head_fused.scaled_logits_(z, temperature, keep)
                del z  # in bf16 the product is freed (unless kept) before the sums read the fp32 copy
                m, sums = _shard_sums_eager(zf, tc, shard, with_entropy)
                del zf
            if shard.group is not None:
                dist.all_reduce(sums, group=shard.group)
            log_z = m + torch.log(sums[0])
            lse[s : s + c] = log_z
            logp[s : s + c] = sums[2] - log_z
            if with_entropy:
                # H = log Z - sum_j p_j z_j, p_j = e_j / sum e (z shifted by m: e_j z_j keeps z unshifted)
                entropy[s : s + c] = log_z - sums[1] / sums[0]
        ctx.save_for_backward(hidden, weight, targets, lse, entropy, *kept)
        ctx.temperature, ctx.chunk, ctx.shard, ctx.with_entropy = temperature, chunk, shard, with_entropy
        ctx.fused = fused
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy, *kept = ctx.saved_tensors
        t, chunk, shard = ctx.temperature, ctx.chunk, ctx.shard
        if not ctx.with_entropy:
            grad_entropy = None
        none = (None,) * 7
        if grad_logp is None and grad_entropy is None:
            return None, None, *none
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden) if need_h else None
        # accumulated in fp32 over the chunks, cast to the weight's dtype once
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        w = weight[: shard.valid]
        grad_of_chunk = head_fused.kernels(ctx.fused).grad if ctx.fused and shard.valid else None
        for i, s in enumerate(range(0, hidden.shape[0], chunk)):
            h = hidden[s : s + chunk].to(w.dtype)
            c = h.shape[0]
            z = kept[i] if kept else h @ w.t()  # the chunk's compute-dtype logits
            part = slice(s, s + c)
            rest = (
                None if grad_entropy is None else entropy[part], targets[part] - shard.start,
                None if grad_logp is None else grad_logp[part],
                None if grad_entropy is None else grad_entropy[part], t, w.dtype,
            )  # fmt: skip
            # a target off this shard (shifted outside [0, valid)) gets no one-hot on this rank
            if grad_of_chunk is not None:  # compiled from the compute-dtype logits
                dz = grad_of_chunk(z, lse[part], *rest)
                del z
            else:  # in place: the fp32 [c x V/tp] log p is made and consumed here, freed before the matmuls
                zf = head_fused.scaled_logits_(z, t, bool(kept))
                del z  # in bf16 a recomputed product is freed before the gradient's arithmetic
                dz = head_fused.eager_chunk_grad_(zf.sub_(lse[part, None]), *rest)
                del zf
            if need_h:
                grad_h[s : s + c] = (dz @ w).to(hidden.dtype)
            if need_w:
                grad_w[: shard.valid].add_((dz.t() @ h).float())
            del dz  # before the next chunk's
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), *none


def chunked_scores(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk: int,
    shard: VocabShard,
    with_entropy: bool,
    fused: head_fused.FusedPath = False,
    keep_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(targets) and the entropy (zeros unless `with_entropy`), fp32 [N], of hidden states
    [N, H] through this rank's vocab-parallel weight rows [V/tp, H]. `fused`: each chunk's arithmetic
    compiled (`head_fused`; `learner.head_kernel`); "triton": where the shard is the whole vocabulary,
    the forward statistics from `head_triton`'s kernel (compiled otherwise). `keep_logits`: the chunks'
    logits kept for the backward where grad mode is on (inside the autograd function it is always off,
    so it is read here; a no-grad scoring pass holding every chunk would only raise its peak)."""
    return VocabParallelHead.apply(hidden, weight, targets, float(temperature), max(1, int(chunk)), shard, with_entropy,
                                   fused, keep_logits and torch.is_grad_enabled())
