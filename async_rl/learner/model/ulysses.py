"""Ulysses sequence parallelism for the torch learner (`learner.sequence_parallel_size`, SP).

The learner group's `world_size` ranks form DP x SP: ranks `d * SP .. d * SP + SP - 1` are the
sequence-parallel group of data-parallel rank `d` (neighbours: one node's fast links). The ranks of
a group train the same shard and build the same micro-batches; each takes a contiguous slice of a
micro-batch's tokens, its rows flattened (`split`), padded to a multiple of SP. Everything but
attention is per token, so each rank runs the embedding, the MLPs, the norms and the chunked head on
its slice only. Around attention (`attention_forward`, registered with transformers as
`IMPLEMENTATION`) an all-to-all trades positions for heads (DeepSpeed-Ulysses): each rank then holds
every position of H / SP query heads (and their K/V heads), reshapes them back into the micro-batch's
rows and runs the same kernel and the same rules as SP = 1 (`attention.py`: the dense mask of the
segment table for SDPA, the varlen or flex layout otherwise); a second all-to-all returns its
positions with every head. Position ids are the full micro-batch's (`attention.position_ids` of its
segment table, sliced), so RoPE, packed rows, shared prompts and padded rows are as at SP = 1.

GQA: an all-to-all needs the K/V heads divisible by SP; where they are not, each is repeated the
fewest times that makes them so (`kv_repeat`: to lcm(K/V heads, SP), which divides the query heads
since both do). Query heads that SP does not divide are refused in one line (SmolLM2's 9 heads: SP
1, 3 or 9; at SP = 3 each rank attends with 3 query heads and 1 K/V head).

The loss: the head's per-token log-probs and entropies are gathered over the group (`gather`: an
all-gather whose backward keeps this rank's slice of the gradient, no communication), so every rank
of a group computes the same full loss of the micro-batch, exactly SP = 1's. Each rank's backward
then reaches the parameters only through its own positions: its gradient is a partial sum over them,
and the gradient of the micro-batch is the sum over the group. The DDP/FSDP2 reduction over the whole
world (every SP rank of every DP rank), scaled by the world size as the backend scales it, is
therefore the sum over DP ranks of each DP rank's full gradient: the backend's contract. Reductions
of token counts and statistics go over the DP group only (`Groups.data`): the SP ranks of a group
hold the same numbers.

On CPU (gloo) every collective here works (`all_to_all_single` included), so tests compare SP = 2 and
SP = 4 with SP = 1 on CPU; NCCL on GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

from async_rl.learner.model.attention import LAYOUT_KWARG as KERNEL_LAYOUT_KWARG
from async_rl.learner.model.attention import (
    AttentionLayout,
    KernelChoice,
    Segments,
    SegmentTable,
    dense_mask,
    layout_for,
    padding_mask_only,
    position_ids,
)
from async_rl.learner.model.attention import attention_forward as plain_attention_forward

IMPLEMENTATION = "async_rl_sp"  # the name registered in transformers' attention interfaces
LAYOUT_KWARG = "sequence_parallel"  # the forward keyword argument that carries a SequenceLayout


# ---- the groups -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Groups:
    """This rank's sequence-parallel group (its size, its place in it, the group itself) and its
    data-parallel group (the ranks with the same place in the other SP groups)."""

    size: int
    rank: int  # within the SP group: which slice of a micro-batch's tokens it holds
    dp_rank: int
    dp_size: int
    sequence: dist.ProcessGroup | None  # None at SP = 1
    data: dist.ProcessGroup | None  # None: the default group (SP = 1)

    @property
    def first(self) -> int:
        """The global rank of this SP group's first rank (the one that fetches the shard)."""
        return self.dp_rank * self.size


def join(size: int, rank: int, world_size: int) -> Groups:
    """Collective over the default group: every rank creates every SP and DP group, in the same order
    (`new_group` asks it of all ranks)."""
    if size == 1:
        return Groups(1, 0, rank, world_size, None, None)
    dp_size = world_size // size
    sequence = data = None
    for d in range(dp_size):
        g = dist.new_group(list(range(d * size, (d + 1) * size)))
        if rank // size == d:
            sequence = g
    for s in range(size):
        g = dist.new_group(list(range(s, world_size, size)))
        if rank % size == s:
            data = g
    return Groups(size, rank % size, rank // size, dp_size, sequence, data)


def check(size: int, world_size: int, heads: int) -> str | None:
    """Why `size` cannot split this model over this world (None when it can), as the end of one line."""
    if world_size % size:
        return f"does not divide learner.world_size={world_size} (world = data parallel x sequence parallel)"
    if heads % size:
        return f"does not divide the model's {heads} attention heads (each rank attends with heads / SP of them)"
    return None


def kv_repeat(size: int, kv_heads: int) -> int:
    """How many times each K/V head is repeated so that SP divides them: to lcm(K/V heads, SP), which
    still divides the query heads (SP and the K/V heads both do)."""
    return math.lcm(kv_heads, size) // kv_heads


# ---- the exchanges (autograd: each one's backward is the other) --------------------------------------------


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """[n_local, H, D] (this rank's positions, every head) -> [n_local * SP, H / SP, D] (every position,
    this rank's heads): rank r sends its positions' head block j to rank j."""
    n, h, d = x.shape
    send = x.reshape(n, size, h // size, d).transpose(0, 1).contiguous()  # [SP (to), n, h/SP, d]
    out = torch.empty_like(send)
    dist.all_to_all_single(out, send, group=group)  # [SP (from), n, h/SP, d]: the senders' positions, in order
    return out.reshape(size * n, h // size, d)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """[n_local * SP, h, D] (every position, this rank's heads) -> [n_local, h * SP, D]."""
    total, h, d = x.shape
    send = x.reshape(size, total // size, h, d).contiguous()  # [SP (to: the positions' owner), n, h, d]
    out = torch.empty_like(send)
    dist.all_to_all_single(out, send, group=group)  # [SP (from: the heads' owner), n, h, d]
    return out.transpose(0, 1).reshape(total // size, size * h, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        return _seq_to_heads(x, group, size)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.group, ctx.size), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        return _heads_to_seq(x, group, size)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.group, ctx.size), None, None


class _GatherPositions(torch.autograd.Function):
    """[n_local, ...] -> [n_local * SP, ...], every rank's slice in order. Every rank of the group then
    computes the same loss from the whole, so the gradient of its own slice is the slice of the whole's
    gradient: the backward cuts it out, no communication (an all-gather's usual reduce-scatter would
    add the SP identical copies)."""

    @staticmethod
    def forward(ctx, x, group, size, rank):
        ctx.rank, ctx.n = rank, x.shape[0]
        out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n], None, None, None


# ---- a micro-batch's slice ----------------------------------------------------------------------------------


@dataclass
class SequenceLayout:
    """What the sequence-parallel attention reads in every layer of one forward."""

    groups: Groups
    rows: int
    width: int
    kv_repeat: int
    # sdpa: bool [rows, 1, width, width] (`attention.dense_mask`); None with `inner`, or where every row is
    # one causal sequence (SDPA's is_causal: no [width x width] tensor at all, the long-sequence case)
    mask: torch.Tensor | None = None
    inner: AttentionLayout | None = None  # varlen / flex: the kernel's layout of the whole micro-batch
    _additive: dict[torch.dtype, torch.Tensor] | None = None

    @property
    def tokens(self) -> int:
        return self.rows * self.width

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask as SDPA's additive float mask in `dtype`, made once per forward: SDPA would convert a
        bool mask in every layer and keep each copy for backward (L^2 floats a layer)."""
        if self._additive is None:
            self._additive = {}
        if dtype not in self._additive:
            zero = torch.zeros((), dtype=dtype, device=self.mask.device)
            self._additive[dtype] = torch.where(self.mask, zero, torch.finfo(dtype).min)
        return self._additive[dtype]


@dataclass
class LocalInputs:
    """This rank's slice of a micro-batch: the HF forward's keyword arguments, the targets and the
    head's flat positions (into the slice), and the micro-batch's shape to gather the scores back into."""

    inputs: dict
    targets: torch.Tensor  # long [1, n_local]
    index: torch.Tensor  # long [N_local]
    rows: int
    width: int


def _segments(seg: Segments | None, rows: int, width: int) -> Segments:
    """The micro-batch's segment table; one segment per row where it has none (the one-token dummy)."""
    if seg is not None:
        return seg
    table = SegmentTable(width)
    for _ in range(rows):
        table.end_row("own")
    return table.build()


def split(input_ids: torch.Tensor, targets: torch.Tensor, seg: Segments | None, index: torch.Tensor,
          groups: Groups, kernels: KernelChoice, kv: int, device: torch.device) -> LocalInputs:
    """This rank's contiguous slice of the micro-batch's flattened tokens (`input_ids`, `targets` [B, T]),
    its position ids, the head's positions `index` (flat, ascending) that fall in it, and the layout of
    the whole micro-batch for attention."""
    rows, width = input_ids.shape
    tokens = rows * width
    n = -(-tokens // groups.size)  # per rank; the last rank's tail is padding
    lo, hi = groups.rank * n, (groups.rank + 1) * n
    seg = _segments(seg, rows, width).to(device)

    def local(flat: torch.Tensor) -> torch.Tensor:
        part = flat[lo:hi]
        return torch.nn.functional.pad(part, (0, n - part.shape[0]))[None]

    kernel = kernels.of(seg)
    layout = SequenceLayout(groups, rows, width, kv)
    if kernel == "sdpa":
        if len(seg.lengths) != rows or seg.shares_prefixes:  # else: one causal sequence a row
            layout.mask = dense_mask(seg)
    else:
        layout.inner = layout_for(seg, kernel)
    # `index` ascends: its slice inside [lo, hi) by two binary searches (a host read of two numbers)
    index = index.to(device)
    a, b = (int(x) for x in torch.searchsorted(index, torch.tensor([lo, hi], device=device)))
    inputs = {
        "input_ids": local(input_ids.to(device).reshape(-1)),
        "position_ids": local(position_ids(seg).reshape(-1)),
        "use_cache": False,
        LAYOUT_KWARG: layout,
    }
    return LocalInputs(inputs, local(targets.to(device).reshape(-1)), index[a:b] - lo, rows, width)


def gather(local: torch.Tensor | None, x: LocalInputs, groups: Groups) -> torch.Tensor | None:
    """[1, n_local, ...] per rank -> [rows, width, ...]: the micro-batch's values in its own layout
    (differentiable: `_GatherPositions`)."""
    if local is None:
        return None
    whole = _GatherPositions.apply(local[0], groups.sequence, groups.size, groups.rank)
    return whole[: x.rows * x.width].reshape(x.rows, x.width, *local.shape[2:])


# ---- attention ------------------------------------------------------------------------------------------------


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF's attention-interface signature (query [1, H, n_local, D], key/value [1, Hkv, n_local, D] ->
    ([1, n_local, H, D], None)): with a `SequenceLayout` in kwargs, the exchange, the micro-batch's
    kernel over every position of this rank's heads, the exchange back; without one (the LoRA base
    reference's padded rows), `attention.attention_forward`."""
    layout: SequenceLayout | None = kwargs.pop(LAYOUT_KWARG, None)
    if layout is None:
        return plain_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                       **kwargs)
    if dropout:
        raise ValueError("learner.sequence_parallel_size: attention dropout is not supported")
    g = layout.groups
    if layout.kv_repeat > 1:
        key, value = (x.repeat_interleave(layout.kv_repeat, dim=1) for x in (key, value))

    def to_rows(x: torch.Tensor) -> torch.Tensor:  # [1, h, n_local, D] -> [rows, h/SP, width, D]
        whole = _SeqToHeads.apply(x[0].transpose(0, 1), g.sequence, g.size)[: layout.tokens]
        return whole.reshape(layout.rows, layout.width, *whole.shape[1:]).transpose(1, 2)

    q, k, v = to_rows(query), to_rows(key), to_rows(value)
    if layout.inner is None:  # SDPA with the segment table's mask (GQA: K/V heads read by their query groups)
        mask = None if layout.mask is None else layout.additive_mask(q.dtype)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]
        ).transpose(1, 2)
    else:
        out, _ = plain_attention_forward(module, q, k, v, None, scaling=scaling, **{KERNEL_LAYOUT_KWARG: layout.inner})
    flat = out.reshape(layout.tokens, *out.shape[2:])  # [tokens, h/SP, D]
    n = query.shape[2]
    flat = torch.nn.functional.pad(flat, (0, 0, 0, 0, 0, n * g.size - layout.tokens))
    return _HeadsToSeq.apply(flat, g.sequence, g.size)[None], None


@lru_cache(maxsize=1)
def register() -> str:
    """Registers `attention_forward` in transformers' attention and mask interfaces (once per process);
    returns the implementation's name for `model.set_attn_implementation`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, padding_mask_only)
    return IMPLEMENTATION
