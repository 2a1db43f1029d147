"""The `smollm2-135m-moe` preset: SmolLM2-135M upcycled into a mixture of experts, for MoE learning runs.

The `smollm2-135m` preset (a real pretrained Llama) becomes a Mixtral (HF `MixtralForCausalLM`, the HF
MoE class with Llama's attention exactly: no biases, no q/k norms, which vLLM serves): each layer's
MLP is copied into EXPERTS experts, each copy perturbed by a little noise (PERTURBATION x the
weight's std) so that which experts a token goes to changes its output, and a fresh router (logits
spread ~1) picks TOP_K of them with Mixtral's renormalised top-k weights. Since the weights of the
chosen experts sum to 1 and the experts are near copies, the upcycled model starts out computing
almost what SmolLM2 computes (its log-probs stay close; measured in docs/moe.md, tested on a tiny
Llama in tests/unit/test_upcycle.py). Converted once
per cache, like the base preset (same lock and atomic rename).
"""

from __future__ import annotations

import os
from pathlib import Path

from async_rl.models import smollm2
from async_rl.models.moe import MoeRouting

NAME = "smollm2-135m-moe"
EXPERTS, TOP_K = 4, 2
BASE_LAYERS = 30  # SmolLM2-135M's layers, every one routed here (checked when converting)
PERTURBATION = 0.01
SEED = 0


def upcycle(base_dir: Path, out: Path) -> None:
    """Write the upcycled Mixtral of the Llama model in `base_dir` into the folder `out`."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        MixtralConfig,
        MixtralForCausalLM,
    )

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    c = base.config
    if c.num_hidden_layers != BASE_LAYERS:  # routing() states the preset's routing before it is built
        raise RuntimeError(f"{NAME}: the base model has {c.num_hidden_layers} layers, not {BASE_LAYERS}")
    config = MixtralConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=c.rope_parameters,
        tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        sliding_window=None,
        dtype="float32",
    )
    model = MixtralForCausalLM(config).to(torch.float32)
    g = torch.Generator().manual_seed(SEED)

    def noisy(w: torch.Tensor) -> torch.Tensor:
        return w + PERTURBATION * w.std() * torch.randn(w.shape, generator=g)

    state = {k: v for k, v in base.state_dict().items() if ".mlp." not in k}
    with torch.no_grad():
        for i, layer in enumerate(base.model.layers):
            mlp, moe = layer.mlp, model.model.layers[i].mlp
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # Mixtral's fused [gate; up]
            moe.experts.gate_up_proj.copy_(torch.stack([noisy(gate_up) for _ in range(EXPERTS)]))
            moe.experts.down_proj.copy_(torch.stack([noisy(mlp.down_proj.weight) for _ in range(EXPERTS)]))
            moe.gate.weight.copy_(torch.randn(moe.gate.weight.shape, generator=g) / c.hidden_size**0.5)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if ".mlp." not in k and not (k == "lm_head.weight" and c.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"{NAME}: upcycled weights do not fit: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    tokenizer.save_pretrained(out)
    GenerationConfig.from_pretrained(base_dir).save_pretrained(out)


def routing() -> MoeRouting:
    """The preset's routing (what models/moe.read_routing reads from its folder), known before it is built."""
    return MoeRouting(num_experts=EXPERTS, top_k=TOP_K, moe_layers=list(range(BASE_LAYERS)), num_layers=BASE_LAYERS)


def ensure(cache_dir: str | os.PathLike) -> Path:
    """The preset's folder in `cache_dir`: the base preset first (fetched on its first use), then the
    upcycled model, converted once."""
    base = smollm2.ensure(cache_dir)
    return smollm2.ensure(cache_dir, build=lambda tmp: upcycle(base, tmp), name=NAME)
