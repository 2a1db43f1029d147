"""Hugging Face <-> Megatron-core weight conversion for the Llama, Qwen2 and Qwen3 families, and the
Qwen3-MoE and Qwen2-MoE mixtures of experts. Pure tensor code.

Two steps, kept apart so each is testable alone:

1. HF names <-> *full* Megatron tensors (as if TP=1), under names with *global* layer indices:
   - q/k/v projections -> `linear_qkv`, in Megatron's per-query-group layout: for each of the
     `num_kv_heads` groups, its `num_heads/num_kv_heads` query heads, then its key head, then its
     value head (rows of `head_dim` each). Qwen2's q/k/v biases follow the same layout.
   - gate/up projections -> `linear_fc1` = concat(gate, up) (the gated MLP chunks it in two).
   - RMSNorm weights: the local layer spec has separate `input_layernorm` / `pre_mlp_layernorm`;
     Transformer Engine's spec fuses them into `linear_qkv.layer_norm_weight` /
     `linear_fc1.layer_norm_weight`.
   - Embedding and output layer rows padded to a vocabulary divisible by TP (padding rows are zero
     and never exported; the learner masks their logits).
   - Tied embeddings: no `output_layer.weight` on a single stage (Megatron reuses the embedding);
     with pipeline stages the last stage holds a copy, which loads from the embedding.
   - Qwen3's per-head q/k RMSNorms -> `self_attention.q_layernorm` / `k_layernorm`.
   - Mixtures of experts (`mlp` is megatron's MoELayer): the router `mlp.gate.weight` ->
     `mlp.router.weight`; transformers 5 holds the experts as two 3-D tensors per layer,
     `mlp.experts.gate_up_proj` [E, 2 x ffn, H] (gate rows, then up rows: already `linear_fc1`'s
     layout per expert) and `mlp.experts.down_proj` [E, H, ffn] (`linear_fc2` per expert); a
     checkpoint on disk (save_pretrained) lists them per expert (`mlp.experts.{e}.gate_proj.weight`
     ...), read as well. Full tensors name expert e `mlp.experts.local_experts.{e}.` (global e);
     Qwen2-MoE's shared expert -> `mlp.shared_experts.linear_fc1/linear_fc2`, its sigmoid gate
     `mlp.shared_expert_gate.weight` -> `mlp.shared_experts.gate_weight`.
2. Full Megatron tensors <-> one tensor-parallel rank's shard (`shard` / `gather`): column-parallel
   layers split rows, row-parallel layers split columns, `linear_fc1` splits gate and up separately,
   `linear_qkv` splits whole query groups (contiguous rows in the per-group layout).
3. Experts over expert-parallel ranks (`expert_shard` / `expert_global_name`): EP rank r holds the
   experts r x E/EP ... (r + 1) x E/EP - 1 as its local experts 0 ... E/EP - 1 (megatron's order),
   each split over the expert-tensor-parallel ranks by step 2's rules. Transformer Engine's grouped
   experts (`TEGroupedMLP`) name local expert j `mlp.experts.linear_fc1.weight{j}`.

Pipeline stages own contiguous blocks of layers; `stage_layers` says which.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgspec
import torch

from async_rl.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")


class HFArch(msgspec.Struct, frozen=True, kw_only=True):
    """What the conversion and the Megatron model need to know about a HF checkpoint. `num_experts` 0:
    a dense model (every `moe_*` and `shared_expert_ffn` field is then 0/False)."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_embeddings: bool
    qkv_bias: bool
    rms_eps: float
    rope_theta: float
    rope_scaling_factor: float  # 0 = none; else Llama-3 style (Megatron's fixed low=1, high=4, 8192)
    max_position_embeddings: int
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on each query and key head
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0  # each expert's intermediate size
    moe_top_k: int = 0
    # Qwen3-MoE's norm_topk_prob: the top-k probabilities renormalised to sum 1 (megatron: top-k of
    # the logits, then softmax over them); without it (Qwen2-MoE) they are the full softmax's
    # (megatron's moe_router_pre_softmax)
    norm_topk_prob: bool = False
    shared_expert_ffn: int = 0  # Qwen2-MoE's shared expert (with its sigmoid gate); 0 = none

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def arch_from_hf_config(cfg: Any) -> HFArch:
    """A transformers `PretrainedConfig` -> HFArch; anything the conversion would get wrong is refused."""
    model_type = getattr(cfg, "model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"learner.backend=megatron converts {SUPPORTED_MODEL_TYPES} models, not model_type '{model_type}'"
        )
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ConfigError(f"learner.backend=megatron: hidden_act '{cfg.hidden_act}' is not supported (only silu)")
    if getattr(cfg, "mlp_bias", False) or (model_type == "llama" and getattr(cfg, "attention_bias", False)):
        raise ConfigError("learner.backend=megatron: Llama with attention_bias/mlp_bias is not supported")
    if model_type.startswith("qwen") and getattr(cfg, "use_sliding_window", False):
        raise ConfigError(f"learner.backend=megatron: {model_type} with use_sliding_window is not supported")
    if model_type in ("qwen3", "qwen3_moe") and getattr(cfg, "attention_bias", False):
        raise ConfigError(f"learner.backend=megatron: {model_type} with attention_bias is not supported")
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    theta, factor = _rope(cfg)
    return HFArch(
        model_type=model_type,
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=cfg.vocab_size,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=model_type in ("qwen2", "qwen2_moe"),
        rms_eps=float(cfg.rms_norm_eps),
        rope_theta=theta,
        rope_scaling_factor=factor,
        max_position_embeddings=cfg.max_position_embeddings,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        **(_moe_fields(cfg) if model_type in MOE_MODEL_TYPES else {}),
    )


def _moe_fields(cfg: Any) -> dict[str, Any]:
    """HFArch's expert fields of a Qwen3-MoE / Qwen2-MoE config; a layout megatron's GPTModel does
    not build (dense layers among the MoE ones) is refused."""
    sparse_step = getattr(cfg, "decoder_sparse_step", 1)
    dense_layers = list(getattr(cfg, "mlp_only_layers", None) or [])
    if sparse_step != 1 or dense_layers:
        raise ConfigError(
            f"learner.backend=megatron: {cfg.model_type} with dense layers among the expert layers "
            f"(decoder_sparse_step={sparse_step}, mlp_only_layers={dense_layers}) is not supported: every layer must be MoE"
        )
    if getattr(cfg, "num_experts_per_tok", 0) > cfg.num_experts:
        raise ConfigError(f"{cfg.model_type}: num_experts_per_tok={cfg.num_experts_per_tok} > num_experts={cfg.num_experts}")
    return {
        "num_experts": int(cfg.num_experts),
        "moe_ffn_hidden_size": int(cfg.moe_intermediate_size),
        "moe_top_k": int(cfg.num_experts_per_tok),
        "norm_topk_prob": bool(getattr(cfg, "norm_topk_prob", False)),
        "shared_expert_ffn": int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0),
    }


def _rope(cfg: Any) -> tuple[float, float]:
    """(theta, llama3 scaling factor or 0). transformers 5 keeps both in `rope_parameters`."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    scaling = dict(getattr(cfg, "rope_scaling", None) or {})
    theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind == "default":
        return theta, 0.0
    llama3_defaults = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if kind == "llama3" and all(float(merged.get(k, v)) == v for k, v in llama3_defaults.items()):
        return theta, float(merged["factor"])
    raise ConfigError(
        f"learner.backend=megatron: rope scaling {merged} is not supported (only none, or llama3 with "
        "low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192)"
    )


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Megatron's vocab-parallel layers need a vocabulary divisible by the TP size."""
    return -(-vocab_size // tp) * tp


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Global indices of the layers pipeline stage `stage` of `pp` owns (equal contiguous blocks)."""
    if num_layers % pp:
        raise ConfigError(f"learner.megatron.pipeline_parallel_size={pp} does not divide the model's {num_layers} layers")
    per = num_layers // pp
    return range(stage * per, (stage + 1) * per)


# ---- step 1: HF <-> full Megatron tensors ---------------------------------------------------------


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: HFArch) -> torch.Tensor:
    """HF q/k/v projections (weights [out, hidden] or biases [out]) -> Megatron's per-group layout."""
    g, hd = arch.num_kv_heads, arch.head_dim
    tail = q.shape[1:]
    per_group = (q.reshape(g, -1, hd, *tail), k.reshape(g, 1, hd, *tail), v.reshape(g, 1, hd, *tail))
    return torch.cat(per_group, dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, arch: HFArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `merge_qkv`."""
    g, hd = arch.num_kv_heads, arch.head_dim
    q_per_group = arch.num_heads // g
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g, q_per_group + 2, hd, *tail)
    q, k, v = grouped.split([q_per_group, 1, 1], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t.clone()
    out = t.new_zeros((rows, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


def _norm_names(te_spec: bool) -> tuple[str, str]:
    if te_spec:
        return "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


def hf_to_megatron_full(
    hf: Mapping[str, torch.Tensor], arch: HFArch, tp: int, pp: int, stage: int, te_spec: bool = False
) -> dict[str, torch.Tensor]:
    """The full (unsharded) Megatron tensors of pipeline stage `stage`, under its *local* names."""
    out: dict[str, torch.Tensor] = {}
    vocab = padded_vocab_size(arch.vocab_size, tp)
    embed = hf["model.embed_tokens.weight"]
    if stage == 0:
        out["embedding.word_embeddings.weight"] = _pad_rows(embed, vocab)
    attn_norm, mlp_norm = _norm_names(te_spec)
    layers = stage_layers(arch.num_layers, pp, stage)
    for local, i in enumerate(layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{local}."
        out[dst + attn_norm] = hf[src + "input_layernorm.weight"].clone()
        a = src + "self_attn."
        out[dst + "self_attention.linear_qkv.weight"] = merge_qkv(
            hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], arch
        )
        if arch.qkv_bias:
            out[dst + "self_attention.linear_qkv.bias"] = merge_qkv(
                hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], arch
            )
        out[dst + "self_attention.linear_proj.weight"] = hf[a + "o_proj.weight"].clone()
        if arch.qk_norm:
            out[dst + "self_attention.q_layernorm.weight"] = hf[a + "q_norm.weight"].clone()
            out[dst + "self_attention.k_layernorm.weight"] = hf[a + "k_norm.weight"].clone()
        m = src + "mlp."
        if arch.is_moe:
            out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"].clone()
            out.update(_experts_to_megatron(hf, m, dst + "mlp.", arch))
            continue
        out[dst + mlp_norm] = hf[src + "post_attention_layernorm.weight"].clone()
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([hf[m + "gate_proj.weight"], hf[m + "up_proj.weight"]])
        out[dst + "mlp.linear_fc2.weight"] = hf[m + "down_proj.weight"].clone()
    if stage == pp - 1:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not arch.tie_embeddings:
            out["output_layer.weight"] = _pad_rows(hf["lm_head.weight"], vocab)
        elif pp > 1:
            out["output_layer.weight"] = _pad_rows(embed, vocab)  # the last stage's copy of the tie
    return out


def megatron_full_to_hf(
    mc: Mapping[str, torch.Tensor], arch: HFArch, pp: int, stage: int, te_spec: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of one stage's full Megatron tensors, in the HF model's order.

    Names are those of the HF model's `named_parameters()`: a tied `lm_head.weight` is not listed
    (vLLM's loader and `transformers` tie it themselves).
    """
    attn_norm, mlp_norm = _norm_names(te_spec)
    if stage == 0:
        yield "model.embed_tokens.weight", mc["embedding.word_embeddings.weight"][: arch.vocab_size]
    for local, i in enumerate(stage_layers(arch.num_layers, pp, stage)):
        src, dst = f"decoder.layers.{local}.", f"model.layers.{i}."
        q, k, v = split_qkv(mc[src + "self_attention.linear_qkv.weight"], arch)
        yield dst + "self_attn.q_proj.weight", q
        if arch.qkv_bias:
            qb, kb, vb = split_qkv(mc[src + "self_attention.linear_qkv.bias"], arch)
            yield dst + "self_attn.q_proj.bias", qb
        yield dst + "self_attn.k_proj.weight", k
        if arch.qkv_bias:
            yield dst + "self_attn.k_proj.bias", kb
        yield dst + "self_attn.v_proj.weight", v
        if arch.qkv_bias:
            yield dst + "self_attn.v_proj.bias", vb
        yield dst + "self_attn.o_proj.weight", mc[src + "self_attention.linear_proj.weight"]
        if arch.qk_norm:
            yield dst + "self_attn.q_norm.weight", mc[src + "self_attention.q_layernorm.weight"]
            yield dst + "self_attn.k_norm.weight", mc[src + "self_attention.k_layernorm.weight"]
        if arch.is_moe:
            yield from _experts_to_hf(mc, src + "mlp.", dst + "mlp.", arch)
        else:
            gate, up = mc[src + "mlp.linear_fc1.weight"].chunk(2, dim=0)
            yield dst + "mlp.gate_proj.weight", gate
            yield dst + "mlp.up_proj.weight", up
            yield dst + "mlp.down_proj.weight", mc[src + "mlp.linear_fc2.weight"]
        yield dst + "input_layernorm.weight", mc[src + attn_norm]
        yield dst + "post_attention_layernorm.weight", mc[src + ("pre_mlp_layernorm.weight" if arch.is_moe else mlp_norm)]
    if stage == pp - 1:
        yield "model.norm.weight", mc["decoder.final_layernorm.weight"]
        if not arch.tie_embeddings:
            yield "lm_head.weight", mc["output_layer.weight"][: arch.vocab_size]


def _experts_to_megatron(hf: Mapping[str, torch.Tensor], m: str, dst: str, arch: HFArch) -> dict[str, torch.Tensor]:
    """One MoE layer's router, experts (and shared expert) as full Megatron tensors; `m` and `dst`
    are the HF and Megatron prefixes of the layer's `mlp.`. The experts come from transformers 5's
    3-D tensors where the mapping has them, else from the per-expert names of a checkpoint on disk."""
    out = {dst + "router.weight": hf[m + "gate.weight"].clone()}
    if m + "experts.gate_up_proj" in hf:
        gate_up, down = hf[m + "experts.gate_up_proj"], hf[m + "experts.down_proj"]
        fc1 = [gate_up[e] for e in range(arch.num_experts)]
        fc2 = [down[e] for e in range(arch.num_experts)]
    else:
        per = [f"{m}experts.{e}." for e in range(arch.num_experts)]
        fc1 = [torch.cat([hf[p + "gate_proj.weight"], hf[p + "up_proj.weight"]]) for p in per]
        fc2 = [hf[p + "down_proj.weight"] for p in per]
    for e in range(arch.num_experts):
        out[f"{dst}experts.local_experts.{e}.linear_fc1.weight"] = fc1[e].clone()
        out[f"{dst}experts.local_experts.{e}.linear_fc2.weight"] = fc2[e].clone()
    if arch.shared_expert_ffn:
        s = m + "shared_expert."
        out[dst + "shared_experts.linear_fc1.weight"] = torch.cat([hf[s + "gate_proj.weight"], hf[s + "up_proj.weight"]])
        out[dst + "shared_experts.linear_fc2.weight"] = hf[s + "down_proj.weight"].clone()
        out[dst + "shared_experts.gate_weight"] = hf[m + "shared_expert_gate.weight"].clone()
    return out


def _experts_to_hf(
    mc: Mapping[str, torch.Tensor], src: str, m: str, arch: HFArch
) -> Iterator[tuple[str, torch.Tensor]]:
    """Inverse of `_experts_to_megatron`, under the HF model's parameter names in its order
    (Qwen3-MoE: experts, then router; Qwen2-MoE: router, experts, shared expert, its gate)."""
    experts = range(arch.num_experts)
    gate_up = torch.stack([mc[f"{src}experts.local_experts.{e}.linear_fc1.weight"] for e in experts])
    down = torch.stack([mc[f"{src}experts.local_experts.{e}.linear_fc2.weight"] for e in experts])
    router = (m + "gate.weight", mc[src + "router.weight"])
    if arch.model_type == "qwen2_moe":
        yield router
    yield m + "experts.gate_up_proj", gate_up
    yield m + "experts.down_proj", down
    if arch.model_type != "qwen2_moe":
        yield router
    if arch.shared_expert_ffn:
        gate, up = mc[src + "shared_experts.linear_fc1.weight"].chunk(2, dim=0)
        yield m + "shared_expert.gate_proj.weight", gate
        yield m + "shared_expert.up_proj.weight", up
        yield m + "shared_expert.down_proj.weight", mc[src + "shared_experts.linear_fc2.weight"]
        yield m + "shared_expert_gate.weight", mc[src + "shared_experts.gate_weight"]


# ---- step 2: full Megatron tensors <-> tensor-parallel shards -------------------------------------


class ShardKind(enum.Enum):
    REPLICATED = "replicated"  # norms
    ROWS = "rows"  # column-parallel and vocab-parallel: split dim 0 (incl. linear_qkv by query group)
    COLUMNS = "columns"  # row-parallel: split dim 1
    GATED_ROWS = "gated_rows"  # linear_fc1: gate and up halves split separately


def shard_kind(name: str) -> ShardKind:
    """How the Megatron parameter `name` is split across tensor-parallel ranks."""
    if name.endswith(("layernorm.weight", "layer_norm_weight", "router.weight", "shared_experts.gate_weight")):
        return ShardKind.REPLICATED
    name = _TE_EXPERT.sub(r"\1", name)  # TE's grouped experts: `linear_fc1.weight{j}`
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return ShardKind.COLUMNS
    if name.endswith("linear_fc1.weight"):
        return ShardKind.GATED_ROWS
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")):
        return ShardKind.ROWS
    raise ValueError(f"no tensor-parallel rule for Megatron parameter '{name}'")


def shard(t: torch.Tensor, kind: ShardKind, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s shard of the full tensor `t` (a copy)."""
    if kind is ShardKind.REPLICATED:
        return t.clone()
    if kind is ShardKind.COLUMNS:
        return t.chunk(tp, dim=1)[rank].clone()
    if kind is ShardKind.GATED_ROWS:
        gate, up = t.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]])
    return t.chunk(tp, dim=0)[rank].clone()


def gather(shards: Sequence[torch.Tensor], kind: ShardKind) -> torch.Tensor:
    """The full tensor from every rank's shard, in rank order (inverse of `shard`)."""
    if kind is ShardKind.REPLICATED:
        return shards[0]
    if kind is ShardKind.COLUMNS:
        return torch.cat(list(shards), dim=1)
    if kind is ShardKind.GATED_ROWS:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(list(shards), dim=0)


def check_parallel_layout(arch: HFArch, tp: int, pp: int, ep: int = 1, etp: int = 1) -> None:
    """Refuse a TP/PP/EP layout the model cannot be split into, naming the config field. `etp`: the
    expert tensor-parallel size (megatron's expert_tensor_parallel_size)."""
    sizes = [("num_key_value_heads", arch.num_kv_heads), ("num_attention_heads", arch.num_heads)]
    sizes += [("shared_expert_intermediate_size", arch.shared_expert_ffn)] if arch.is_moe else [
        ("intermediate_size", arch.ffn_hidden_size)]
    for what, n in sizes:
        if n % tp:
            raise ConfigError(f"learner.megatron.tensor_parallel_size={tp} does not divide the model's {what}={n}")
    if ep > 1 and not arch.is_moe:
        raise ConfigError(f"learner.megatron.expert_model_parallel_size={ep} needs a mixture-of-experts model, "
                          f"not the dense {arch.model_type}")
    if arch.is_moe and arch.num_experts % ep:
        raise ConfigError(f"learner.megatron.expert_model_parallel_size={ep} does not divide the model's "
                          f"num_experts={arch.num_experts}")
    if arch.is_moe and arch.moe_ffn_hidden_size % etp:
        raise ConfigError(f"expert tensor parallelism {etp} does not divide the model's "
                          f"moe_intermediate_size={arch.moe_ffn_hidden_size}")
    stage_layers(arch.num_layers, pp, 0)


# ---- step 3: experts over expert-parallel ranks ---------------------------------------------------

_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
_TE_EXPERT = re.compile(r"(linear_fc[12]\.weight)\d+$")
_TE_LOCAL = re.compile(r"^(.*\.mlp\.experts\.)(linear_fc[12]\.weight)(\d+)$")


def is_expert(name: str) -> bool:
    """Whether the Megatron parameter `name` (full or local, either spec) belongs to a routed expert
    (split over expert-parallel ranks; the router and the shared expert are not)."""
    return bool(_EXPERT.match(name) or _TE_LOCAL.match(name))


def expert_shard(full: Mapping[str, torch.Tensor], arch: HFArch, ep: int, ep_rank: int, te_spec: bool) -> dict[str, torch.Tensor]:
    """`full` with only the experts expert-parallel rank `ep_rank` of `ep` holds, under their local
    names (megatron's local spec, or TE's grouped experts); every other tensor as it is."""
    per = arch.num_experts // ep
    out: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        hit = _EXPERT.match(name)
        if hit is None:
            out[name] = t
            continue
        local = int(hit[2]) - ep_rank * per
        if 0 <= local < per:
            out[_local_expert_name(hit[1], local, hit[3], te_spec)] = t
    return out


def _local_expert_name(prefix: str, local: int, which: str, te_spec: bool) -> str:
    return f"{prefix}{which}{local}" if te_spec else f"{prefix}local_experts.{local}.{which}"


def expert_global_name(name: str, arch: HFArch, ep: int, ep_rank: int) -> str:
    """The full-tensor name (global expert index) of a local expert parameter of EP rank `ep_rank`."""
    per = arch.num_experts // ep
    hit = _EXPERT.match(name)
    if hit is not None:
        return f"{hit[1]}local_experts.{ep_rank * per + int(hit[2])}.{hit[3]}"
    hit = _TE_LOCAL.match(name)
    if hit is None:
        raise ValueError(f"'{name}' is not an expert parameter")
    return f"{hit[1]}local_experts.{ep_rank * per + int(hit[3])}.{hit[2]}"
