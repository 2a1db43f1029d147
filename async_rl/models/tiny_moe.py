"""Tiny random-init mixture-of-experts models built offline from code: the MoE presets and the tests' models.

One builder for three router families, so that routing replay is exercised on more than one kind of
router: Qwen3-MoE (softmax over the experts, top-k, the top-k weights renormalised, q/k norms), Qwen2-MoE
(top-k without renormalisation, plus a shared expert behind a sigmoid gate) and Mixtral (Llama's attention,
top-k always renormalised: the upcycled smollm2-135m-moe preset's class). The sizes are a `TinyMoe`; the
presets `tiny-qwen3-moe` and `tiny-qwen2-moe` (PRESETS) are 2 layers, 8 experts, top-2, hidden 128,
head_dim 32 (vLLM's CPU attention needs >= 32), fp32, tied embeddings; tests pick smaller ones.

The routers are initialised so that their logits spread by about `router_logit_std` (weights of std
router_logit_std/sqrt(hidden), drawn from their own generator): at HF's default std 0.02 the logits differ
by ~0.1 and a top-2 choice is more often a near-tie that float rounding decides, which neither a test of
the capture nor a learning run wants.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from async_rl.models.moe import MoeRouting

if TYPE_CHECKING:
    import torch

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")  # HF model_type


class TinyMoe(NamedTuple):
    """The sizes of a tiny MoE model (every layer routed; head_dim = hidden_size / heads)."""

    family: str  # one of FAMILIES
    hidden_size: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    experts: int = 8
    top_k: int = 2
    expert_width: int = 64  # a routed expert's intermediate size
    dense_width: int = 256  # Qwen-MoE's dense MLP width (layers in mlp_only_layers); Mixtral has none
    shared_width: int = 0  # Qwen2-MoE's shared expert's intermediate size
    norm_topk_prob: bool = True  # Qwen-MoE: renormalise the top-k weights (Mixtral always does)
    max_positions: int = 512
    tie_embeddings: bool = True
    router_logit_std: float = 1.0

    def routing(self) -> MoeRouting:
        """What the built model's config.json says about its routing (models/moe.read_routing)."""
        return MoeRouting(
            num_experts=self.experts, top_k=self.top_k, moe_layers=list(range(self.layers)), num_layers=self.layers
        )


PRESETS: dict[str, TinyMoe] = {
    "tiny-qwen3-moe": TinyMoe("qwen3_moe", norm_topk_prob=True),
    "tiny-qwen2-moe": TinyMoe("qwen2_moe", shared_width=64, norm_topk_prob=False),
}


def hf_config(shape: TinyMoe, vocab_size: int, eos_id: int | None = None, pad_id: int | None = None):
    """The transformers config of `shape` (the special token ids left at the family's defaults where None)."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        num_experts_per_tok=shape.top_k,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=shape.tie_embeddings,
        dtype="float32",
    )
    if eos_id is not None:
        common |= dict(eos_token_id=eos_id, bos_token_id=eos_id)
    if pad_id is not None:
        common |= dict(pad_token_id=pad_id)
    qwen = dict(
        num_experts=shape.experts,
        moe_intermediate_size=shape.expert_width,
        intermediate_size=shape.dense_width,
        norm_topk_prob=shape.norm_topk_prob,
    )
    head_dim = shape.hidden_size // shape.heads
    if shape.family == "qwen3_moe":
        return Qwen3MoeConfig(**common, **qwen, head_dim=head_dim)
    if shape.family == "qwen2_moe":
        return Qwen2MoeConfig(**common, **qwen, shared_expert_intermediate_size=shape.shared_width)
    if shape.family == "mixtral":
        return MixtralConfig(
            **common, num_local_experts=shape.experts, intermediate_size=shape.expert_width, head_dim=head_dim
        )
    raise ValueError(f"tiny MoE family {shape.family!r} is not one of {FAMILIES}")


def build(
    shape: TinyMoe,
    vocab_size: int,
    eos_id: int | None = None,
    pad_id: int | None = None,
    seed: int = 0,
    dtype: torch.dtype | None = None,
) -> torch.nn.Module:
    """A random-init `shape` model (transformers' own class for its family), fp32 unless `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(shape, vocab_size, eos_id, pad_id), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # decisive routers (see the module doc): every layer's `mlp.gate`
        for layer in model.model.layers:
            w = layer.mlp.gate.weight
            w.copy_(torch.randn(w.shape, generator=g) * shape.router_logit_std / w.shape[1] ** 0.5)
    return model.to(dtype or torch.float32)


def preset(name: str, vocab_size: int, eos_id: int, pad_id: int, seed: int = 0) -> torch.nn.Module:
    """The MoE preset `name` (a key of PRESETS) for a tokenizer of `vocab_size` ids."""
    return build(PRESETS[name], vocab_size, eos_id, pad_id, seed)
