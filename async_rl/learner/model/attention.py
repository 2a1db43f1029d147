"""The torch learner's attention over its micro-batches (`learner.attention`), with the layout each
kernel reads built on the device from a compact segment table.

A micro-batch is `rows x width` token positions cut into *segments*: a packed sequence, a padded
row's sequence and its padding, a shared prompt's prefix, one sample's suffix (`shared_prefix.py`).
The host builds only the table (`Segments`: one length and one prefix index per segment, O(sequences)
numbers); position ids, the dense mask of the SDPA path, the cumulative lengths of varlen attention
and FlexAttention's block mask are built from it where the model runs. Rules, the same for every kernel:

- a token attends causally within its segment;
- a suffix also attends to its block's whole prefix (`prefix`), which lies before it in its row;
- nothing else: no token sees another sequence, another block or padding.

Kernels:

- `sdpa`: Hugging Face's SDPA as before. Packed rows pass position ids only (HF derives its
  packed-sequence mask from them); shared-prompt blocks pass a dense boolean [rows, 1, T, T] mask;
  padded rows their 2D padding mask. The CPU path.
- `varlen`: varlen flash attention (`torch.nn.attention.varlen.varlen_attn`, CUDA) over the
  micro-batch's tokens flattened to one sequence of segments: cumulative lengths, no mask, GQA
  without repeating K/V. A shared prefix is read through a gathered key/value index (each suffix's
  keys are its prefix's then its own), and causality aligns the query's end with the key's end, as
  flash attention does when a query is shorter than its keys (PrefixGrouper's scheme). On CPU the
  same contract runs as per-segment SDPA (`reference_varlen`: exact and differentiable, slow), so the
  layout and its gradients are tested without CUDA.
- `flex`: FlexAttention with a block mask of the rules above, its tile tables built on the device
  from the segment table by tensor ops (`attention_flex`: no `create_block_mask`, whose compiled
  mask evaluation recompiled per packed length), the tokens padded to a multiple of the 128-token
  tile, the kernel compiled once with dynamic shapes on CUDA so new packed lengths reuse its graph.
  On CPU torch runs its forward only, eagerly (no backward), so training refuses it there.
- `auto`: `sdpa` on CPU; on CUDA `varlen` for micro-batches without shared prompts and `flex` for
  shared-prompt blocks (`flex` for both where the attention computes in fp32, which flash attention
  does not take): the choice expected from the first H100 profile (the dense mask makes cuDNN
  compute every tile), to be confirmed by `make gpu-check`'s learner benchmark.

The kernels plug into HF models through transformers' attention registry: one registered
implementation (`async_rl`) reads the micro-batch's `AttentionLayout` from the forward's keyword
arguments, which HF passes down to every attention layer. Called without one (the LoRA base
reference's padded rows), it is HF's SDPA with HF's own padding mask.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import torch

from async_rl.learner.model import attention_flex
from async_rl.learner.model.attention_flex import FlexMask
from async_rl.models.cost import Layout

Kernel = Literal["sdpa", "varlen", "flex"]
IMPLEMENTATION = "async_rl"  # the name registered in transformers' attention interfaces
LAYOUT_KWARG = "attention_layout"  # the forward keyword argument that carries an AttentionLayout


# ---- the host-built segment table -------------------------------------------------------------------


@dataclass
class Segments:
    """How a micro-batch's rows cut into attention segments: every row covered whole, rows in order,
    segments in column order. O(sequences) numbers, built on the host; everything per token is built
    from it on the device."""

    rows: int
    width: int
    lengths: torch.Tensor  # long [S]
    prefix: torch.Tensor  # long [S]: the segment whose keys it also reads (its block's prefix), -1: none
    max_len: int  # the longest segment (host int: the kernels need it without a device sync)
    max_keys: int  # the most keys a segment reads (its prefix's and its own)
    key_tokens: int  # keys summed over segments (= rows * width without shared prefixes)

    @property
    def shares_prefixes(self) -> bool:
        return self.key_tokens != self.rows * self.width

    def layout(self) -> Layout:
        """The micro-batch's shape as `models.cost.CostModel` reads it (its executed cost per path)."""
        lengths, prefix = self.lengths.tolist(), self.prefix.tolist()
        return Layout(self.rows, self.width, [(n, lengths[p] if p >= 0 else 0) for n, p in zip(lengths, prefix, strict=True)])

    def to(self, device: torch.device) -> Segments:
        return Segments(self.rows, self.width, self.lengths.to(device), self.prefix.to(device),
                        self.max_len, self.max_keys, self.key_tokens)


class SegmentTable:
    """Builds `Segments` row by row: `add` a segment (its prefix: a segment of the same row added
    before it, by the index `add` returned), `end_row` covers the row's unused tail."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.lengths: list[int] = []
        self.prefix: list[int] = []
        self.rows = 0
        self._used = 0

    def add(self, length: int, prefix: int = -1) -> int:
        if length <= 0:
            raise ValueError(f"a segment of {length} tokens")
        self.lengths.append(length)
        self.prefix.append(prefix)
        self._used += length
        return len(self.lengths) - 1

    def end_row(self, tail: Literal["extend", "own"]) -> None:
        """The row's unused tail: `extend` lengthens its last segment (a packed row's tail continues its
        last sequence, as its position ids do: after every real token, causality keeps it from them);
        `own` makes it a segment of its own (padding, which sees only padding)."""
        rest = self.width - self._used
        if rest < 0:
            raise ValueError(f"a row of {self._used} tokens in width {self.width}")
        if rest and tail == "extend" and self._used:
            self.lengths[-1] += rest
        elif rest:
            self.add(rest)
        self.rows += 1
        self._used = 0

    def build(self) -> Segments:
        keys = [n + (self.lengths[p] if p >= 0 else 0) for n, p in zip(self.lengths, self.prefix, strict=True)]
        return Segments(
            rows=self.rows, width=self.width,
            lengths=torch.tensor(self.lengths, dtype=torch.long), prefix=torch.tensor(self.prefix, dtype=torch.long),
            max_len=max(self.lengths), max_keys=max(keys), key_tokens=sum(keys),
        )


# ---- per-token tensors, built where the model runs ------------------------------------------------------


def _starts(seg: Segments) -> torch.Tensor:
    return torch.cumsum(seg.lengths, 0) - seg.lengths


def token_segments(seg: Segments) -> torch.Tensor:
    """long [rows * width]: the segment of each position (flattened rows)."""
    n = seg.rows * seg.width
    ids = torch.arange(len(seg.lengths), device=seg.lengths.device)
    return torch.repeat_interleave(ids, seg.lengths, output_size=n)  # output_size: no device sync


def position_ids(seg: Segments) -> torch.Tensor:
    """long [rows, width]: positions restart at 0 in every segment; a suffix continues its prefix."""
    ids = token_segments(seg)
    offset = torch.where(seg.prefix >= 0, seg.lengths[seg.prefix.clamp(min=0)], 0)
    flat = torch.arange(len(ids), device=ids.device) - _starts(seg)[ids] + offset[ids]
    return flat.view(seg.rows, seg.width)


def dense_mask(seg: Segments) -> torch.Tensor:
    """bool [rows, 1, width, width] (True = may attend): the rules as a dense mask, for SDPA."""
    ids = token_segments(seg).view(seg.rows, seg.width)
    own_prefix = seg.prefix[ids]
    causal = torch.ones(seg.width, seg.width, dtype=torch.bool, device=ids.device).tril()
    same = ids[:, :, None] == ids[:, None, :]
    onto_prefix = own_prefix[:, :, None] == ids[:, None, :]
    return (causal & (same | onto_prefix)).unsqueeze(1)


def key_index(seg: Segments) -> torch.Tensor:
    """long [key_tokens]: for each segment in order, its prefix's positions then its own (flattened)."""
    starts = _starts(seg)
    has = seg.prefix >= 0
    pre = seg.prefix.clamp(min=0)
    pre_len = torch.where(has, seg.lengths[pre], 0)
    keys = seg.lengths + pre_len
    owner = torch.repeat_interleave(torch.arange(len(keys), device=keys.device), keys, output_size=seg.key_tokens)
    at = torch.arange(seg.key_tokens, device=keys.device) - (torch.cumsum(keys, 0) - keys)[owner]
    in_prefix = at < pre_len[owner]
    return torch.where(in_prefix, starts[pre][owner] + at, starts[owner] + at - pre_len[owner])


def cumulative(lengths: torch.Tensor) -> torch.Tensor:
    """int32 [S + 1]: 0, then the running sums (flash attention's cu_seqlens)."""
    return torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


# ---- the layout a forward carries -------------------------------------------------------------------------


@dataclass
class AttentionLayout:
    """What the registered attention reads in every layer of one forward: built once per micro-batch."""

    kernel: Kernel
    cu_q: torch.Tensor | None = None  # varlen: int32 [S + 1]
    cu_k: torch.Tensor | None = None  # varlen: int32 [S + 1]
    max_q: int = 0
    max_k: int = 0
    keys: torch.Tensor | None = None  # varlen with shared prefixes: long [key_tokens] gather index
    flex: FlexMask | None = None  # flex: the block mask over the flattened tokens, padded


def varlen_layout(seg: Segments) -> AttentionLayout:
    cu_q = cumulative(seg.lengths)
    if not seg.shares_prefixes:
        return AttentionLayout("varlen", cu_q, cu_q, seg.max_len, seg.max_len)
    pre_len = torch.where(seg.prefix >= 0, seg.lengths[seg.prefix.clamp(min=0)], 0)
    return AttentionLayout("varlen", cu_q, cumulative(seg.lengths + pre_len), seg.max_len, seg.max_keys, key_index(seg))


def flex_layout(seg: Segments) -> AttentionLayout:
    return AttentionLayout("flex", flex=attention_flex.build(seg.lengths, seg.prefix, seg.rows * seg.width))


@dataclass(frozen=True)
class KernelChoice:
    """The kernel of each kind of micro-batch: without shared prompts, and with shared-prompt blocks."""

    unshared: Kernel = "sdpa"
    shared: Kernel = "sdpa"

    def of(self, seg: Segments) -> Kernel:
        return self.shared if seg.shares_prefixes else self.unshared

    @property
    def uses_registry(self) -> bool:
        """Whether some micro-batch runs the registered implementation (else HF's SDPA stays set)."""
        return self.unshared != "sdpa" or self.shared != "sdpa"


SDPA = KernelChoice()


def resolve(setting: str, device_type: str, half: bool) -> KernelChoice:
    """`learner.attention` on this device; `half`: the attention computes in bf16/fp16 (flash attention
    takes nothing else). Raises ValueError saying why a setting cannot train here."""
    if setting == "auto":
        if device_type != "cuda":
            return SDPA
        # varlen for shared-prompt blocks too: measured on an H200 (2026-11-26), flex's compiled block
        # masks made the 0.5B step miss a 90 s limit while varlen took 2.59 s (docs/learner.md). Flash
        # takes no fp32, and flex is not trusted yet: fp32 compute keeps sdpa.
        return KernelChoice("varlen", "varlen") if half else SDPA
    if setting == "flex" and device_type != "cuda":
        raise ValueError("FlexAttention has no backward on CPU in torch (its forward runs eagerly): use sdpa or auto there")
    if setting == "varlen" and device_type == "cuda" and not half:
        raise ValueError("flash attention computes in bf16/fp16 only: set learner.mixed_precision bf16 (or use flex)")
    return KernelChoice(setting, setting)  # type: ignore[arg-type]


# ---- the kernels --------------------------------------------------------------------------------------------


def reference_varlen(q, k, v, cu_q, cu_k, scale: float | None) -> torch.Tensor:
    """varlen attention's contract as per-segment SDPA (CPU; exact, differentiable, slow): causal with
    the query's last position aligned to the key's last. q [Tq, H, D], k/v [Tk, Hkv, D]."""
    out = []
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bq) - 1):
        qs = q[bq[i] : bq[i + 1]].transpose(0, 1)
        ks, vs = k[bk[i] : bk[i + 1]].transpose(0, 1), v[bk[i] : bk[i + 1]].transpose(0, 1)
        lq, lk = qs.shape[1], ks.shape[1]
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        o = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=allowed, scale=scale, enable_gqa=qs.shape[0] != ks.shape[0]
        )
        out.append(o.transpose(0, 1))
    return torch.cat(out)


@lru_cache(maxsize=1)
def _varlen_call():
    """torch's varlen_attn, called the way this torch spells it: 2.13 takes `window_size=(-1, 0)` for
    causal and `enable_gqa`; earlier releases (the GPU image's 2.11 may) take `is_causal` and may lack
    `enable_gqa`, in which case K/V heads are repeated. Checked once, from the signature."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    gqa = "enable_gqa" in params
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}

    def call(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        if not gqa and k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        extra = {"enable_gqa": True} if gqa else {}
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, **causal, **extra)

    return call


def varlen_attention(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float | None) -> torch.Tensor:
    """Causal varlen flash attention over packed segments (CUDA; q [Tq, H, D], k/v [Tk, Hkv, D]),
    called as this torch spells it (`_varlen_call`)."""
    return _varlen_call()(q, k, v, cu_q, cu_k, max_q, max_k, scale)


def _flex(q, k, v, mask: FlexMask, scale):
    """q [1, H, T, D], k/v [1, Hkv, T, D] -> [1, H, T, D]: padded to the mask's length, run, cut back."""
    group = q.shape[1] // k.shape[1]
    if group & (group - 1):
        # Inductor's flex decoding kernel (which it may pick for short queries) takes only power-of-2
        # query groups per KV head (Qwen2.5-0.5B: 14 / 2 = 7); HF's flex integration repeats K/V then too
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    pad = mask.length - mask.tokens
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    if q.device.type == "cuda":
        out = attention_flex.compiled_flex()(q, k, v, block_mask=mask.block_mask, scale=scale, enable_gqa=True)
    else:
        # inductor's CPU flex template fails to build with dynamic shapes (torch 2.13), and CPU has
        # no flex backward anyway: the eager forward
        from torch.nn.attention.flex_attention import flex_attention

        out = flex_attention(q, k, v, block_mask=mask.block_mask, scale=scale, enable_gqa=True)
    return out[:, :, : mask.tokens]


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF's attention-interface signature: query [B, H, T, D], key/value [B, Hkv, T, D] -> ([B, T, H, D],
    None). With an `AttentionLayout` in kwargs, the micro-batch's kernel over its flattened tokens."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layout: AttentionLayout | None = kwargs.pop(LAYOUT_KWARG, None)
    if layout is None or layout.kernel == "sdpa":
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if dropout:
        raise ValueError(f"learner.attention={layout.kernel}: attention dropout is not supported")
    if torch.is_autocast_enabled(query.device.type):
        # SDPA is on autocast's list, these kernels are not: the rotary embedding left q and k in the
        # residual stream's fp32, so cast them as autocast would have (flash takes bf16/fp16 only)
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    b, h, t, d = query.shape
    hk = key.shape[1]
    if layout.kernel == "flex":
        def flat(x: torch.Tensor) -> torch.Tensor:  # [B, H, T, D] -> [1, H, B*T, D]
            return x.transpose(0, 1).reshape(1, x.shape[1], b * t, d)

        out = _flex(flat(query), flat(key), flat(value), layout.flex, scaling)
        return out[0].view(h, b, t, d).permute(1, 2, 0, 3), None
    q = query.transpose(1, 2).reshape(b * t, h, d)
    k = key.transpose(1, 2).reshape(b * t, hk, d)
    v = value.transpose(1, 2).reshape(b * t, hk, d)
    if layout.keys is not None:
        k, v = k.index_select(0, layout.keys), v.index_select(0, layout.keys)
    if q.device.type == "cuda":
        out = _varlen_call()(q, k, v, layout.cu_q, layout.cu_k, layout.max_q, layout.max_k, scaling)
    else:
        out = reference_varlen(q, k, v, layout.cu_q, layout.cu_k, scaling)
    return out.view(b, t, h, d), None


def padding_mask_only(**kwargs):
    """The mask HF builds for the registered implementation: SDPA's when a 2D padding mask is given
    (a call without our layout), none otherwise (the layout is the mask)."""
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(**kwargs) if kwargs.get("attention_mask") is not None else None


@lru_cache(maxsize=1)
def register() -> str:
    """Registers `attention_forward` in transformers' attention and mask interfaces (once per process);
    returns the implementation's name for `model.set_attn_implementation`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, padding_mask_only)
    return IMPLEMENTATION


# ---- a micro-batch's model inputs ---------------------------------------------------------------------------


def layout_for(seg: Segments, kernel: Kernel) -> AttentionLayout | None:
    if kernel == "varlen":
        return varlen_layout(seg)
    if kernel == "flex":
        return flex_layout(seg)
    return None
