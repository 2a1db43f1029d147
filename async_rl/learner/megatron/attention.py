"""The core attention of megatron's local layer spec (no Transformer Engine) through torch's fused
kernels (`learner.megatron.attention`), in place of megatron's `DotProductAttention`, which keeps
every fp32 score [rows, heads/TP, T, T] of every layer for backward (9.57 s a step and out of
memory at 16k tokens on the 0.5B shape, ../shared/gpu/README.md).

- `sdpa`: `scaled_dot_product_attention` with the mask the backend builds, in megatron's convention
  (boolean, True = masked; or an additive float mask, which every layer of a micro-batch shares
  rather than each converting the boolean one), or causal where none is given (megatron's local
  softmax generates that one). Causal without a mask lets CUDA pick flash attention, GQA native
  (`enable_gqa`); with a mask the K/V heads are repeated as megatron's local attention does, so the
  memory-efficient kernel (which takes a mask, not GQA) runs, not the math one.
- `varlen`: a packed micro-batch flattened to one row of tokens, its sequences bounded by cumulative
  lengths (`PackedRow`, below): `torch.nn.attention.varlen.varlen_attn` on CUDA (16-bit only: flash
  attention), no mask, GQA native; on CPU the same contract as per-sequence SDPA
  (`learner.attention.reference_varlen`), so it is tested without CUDA. The row is not megatron's
  THD format: with THD, megatron's RoPE without Transformer Engine (`_apply_rotary_pos_emb_thd`) cuts
  the row into its sequences on the host (`tolist`, a sync) and rotates each one in its own kernels,
  in every layer, for queries and keys, forward and backward (about 40 sequences in a 16k micro-batch
  of the 1-GPU recipe). As one row megatron rotates all of it at once, each token by its own position
  id (`megatron.rotary`). Shared prompts (`learner.share_prompt`) take the same path: each suffix's
  keys are gathered as its prefix's then its own (the torch backend's layout, `varlen_layout`). THD
  (what TE's attention reads) still works here.

Scores computed this way are the local spec's up to rounding: the same scale, causal and mask
rules; megatron's masked entries (-10000 before the fp32 softmax) and SDPA's (-inf) both give 0.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from async_rl.learner.model.attention import AttentionLayout, reference_varlen, varlen_attention

Setting = Literal["auto", "local", "sdpa", "varlen"]
Kernel = Literal["local", "sdpa", "varlen"]


def resolve(setting: str, device_type: str, dtype: torch.dtype) -> Kernel:
    """The kernel `learner.megatron.attention` names. auto = varlen on CUDA in a 16-bit model (the
    kernel the torch backend's auto runs there, measured faster than SDPA with a mask: docs/learner.md),
    else sdpa; varlen on CUDA needs a 16-bit model (flash attention takes no fp32)."""
    if setting == "auto":
        return "varlen" if device_type == "cuda" and dtype in (torch.bfloat16, torch.float16) else "sdpa"
    if setting not in ("local", "sdpa", "varlen"):
        raise ValueError(f"learner.megatron.attention={setting!r}: expected auto, local, sdpa or varlen")
    if setting == "varlen" and device_type == "cuda" and dtype == torch.float32:
        raise ValueError("learner.megatron.attention=varlen on CUDA needs model.dtype bfloat16 or float16 (flash attention)")
    return setting  # type: ignore[return-value]


def _module_base() -> type:
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


def core_attention_class() -> type:
    """`TorchCoreAttention`, a megatron `MegatronModule` (defined on first use: megatron-core is
    imported lazily by the backend)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _define(_module_base())
    return _CLASS


_CLASS: type | None = None
_ROW: type | None = None


def packed_row(layout: AttentionLayout, tokens: int) -> Any:
    """megatron's `PackedSeqParams` for a packed micro-batch given as one row of `tokens` tokens
    (`varlen`, module docstring), carrying the varlen `layout` (`learner.attention.varlen_layout`:
    cumulative query and key lengths, the longest of each, and for shared prompts the gather index of
    each suffix's keys). `qkv_format` "sbhd" so that megatron keeps the row's layout and rotates it
    whole (by position id: `megatron.rotary`); `max_seqlen_q/kv` = `tokens`, the length megatron sizes
    its RoPE table by (`get_rotary_seq_len`); the flash kernel's bounds are the layout's longest
    (the row's length there would launch ~T/128 query blocks per sequence, nearly all empty)."""
    global _ROW
    if _ROW is None:
        from dataclasses import dataclass

        from megatron.core.packed_seq_params import PackedSeqParams

        @dataclass
        class PackedRow(PackedSeqParams):
            layout: AttentionLayout | None = None

        _ROW = PackedRow
    return _ROW(
        qkv_format="sbhd", cu_seqlens_q=layout.cu_q, cu_seqlens_kv=layout.cu_k, max_seqlen_q=tokens,
        max_seqlen_kv=tokens, layout=layout,
    )


def _define(base: type) -> type:
    class TorchCoreAttention(base):  # type: ignore[misc, valid-type]
        """megatron's `core_attention` submodule contract (the constructor and forward of
        `DotProductAttention`) on torch's SDPA and varlen kernels (module docstring)."""

        def __init__(
            self,
            config: Any,
            layer_number: int,
            attn_mask_type: Any,
            attention_type: str,
            attention_dropout: float | None = None,
            softmax_scale: float | None = None,
            cp_comm_type: str | None = None,
            pg_collection: Any = None,
        ) -> None:
            super().__init__(config=config)
            dropout = config.attention_dropout if attention_dropout is None else attention_dropout
            if dropout or config.softmax_type != "vanilla" or config.window_size is not None:
                raise ValueError(
                    "learner.megatron.attention sdpa/varlen: attention dropout, window attention and "
                    "non-vanilla softmax are not supported (use local)"
                )
            if config.context_parallel_size != 1:
                raise ValueError("learner.megatron.attention sdpa/varlen: context parallelism needs Transformer Engine")
            if pg_collection is None:
                from megatron.core import parallel_state

                tp = parallel_state.get_tensor_model_parallel_world_size()
            else:
                tp = pg_collection.tp.size()
            self.heads = config.num_attention_heads // tp
            self.groups = config.num_query_groups // tp
            head_dim = config.kv_channels
            # megatron's query-key layer scaling divides the scale by the layer number and multiplies
            # the scores back before the softmax: no net change, so it is left out
            self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
            self.attn_mask_type = attn_mask_type

        def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: torch.Tensor | None,
            attn_mask_type: Any = None,
            attention_bias: torch.Tensor | None = None,
            packed_seq_params: Any = None,
        ) -> torch.Tensor:
            if attention_bias is not None:
                raise ValueError("learner.megatron.attention sdpa/varlen: attention bias is not supported")
            if packed_seq_params is not None:
                return self._varlen(query, key, value, packed_seq_params)
            return self._sdpa(query, key, value, attention_mask)

        def _sdpa(self, query, key, value, mask):
            # [s, b, heads, d] -> [b, heads, s, d]
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            group = self.heads // self.groups
            gqa = False
            if mask is not None:
                if mask.dtype == torch.bool:
                    mask = ~mask  # megatron: True = masked; SDPA: True = attends
                if group > 1:
                    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            else:
                gqa = group > 1
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.softmax_scale, enable_gqa=gqa
            )
            s, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, heads/TP x d]

        def _varlen(self, query, key, value, p):
            if _ROW is not None and isinstance(p, _ROW):  # `packed_row`: [t, 1, heads, d]
                query, key, value = (x.squeeze(1) for x in (query, key, value))
                layout = p.layout
                if layout.keys is not None:  # shared prompts: each suffix's keys are its prefix's, then its own
                    key, value = key.index_select(0, layout.keys), value.index_select(0, layout.keys)
                cu_q, cu_k, longest_q, longest_k = layout.cu_q, layout.cu_k, layout.max_q, layout.max_k
            elif p.qkv_format == "thd":  # [t, heads, d]: megatron squeezed the one row's batch dimension
                cu_q, cu_k, longest_q, longest_k = p.cu_seqlens_q, p.cu_seqlens_kv, p.max_seqlen_q, p.max_seqlen_kv
            else:
                raise ValueError(f"learner.megatron.attention: packed format {p.qkv_format!r} (thd or packed_row)")
            if query.is_cuda:
                out = varlen_attention(query, key, value, cu_q, cu_k, longest_q, longest_k, self.softmax_scale)
            else:
                out = reference_varlen(query, key, value, cu_q, cu_k, self.softmax_scale)
            # megatron reshapes THD's [t, heads x d] itself; a row goes back as [s, b=1, heads x d]
            return out.reshape(out.shape[0], 1, -1) if p.qkv_format != "thd" else out.reshape(out.shape[0], -1)

    return TorchCoreAttention
