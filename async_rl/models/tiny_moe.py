"""Tiny random-init mixture-of-experts models for the MoE presets, built offline from code.

Two router families, so that routing replay is exercised on more than one kind of router:
`tiny-qwen3-moe` (Qwen3-MoE: softmax over the experts, top-2, the top-k weights renormalised, q/k
norms) and `tiny-qwen2-moe` (Qwen2-MoE: top-2 without renormalisation, plus a shared expert behind a
sigmoid gate). Both: 2 layers, 8 experts, hidden 128, head_dim 32 (vLLM's CPU attention needs >= 32),
fp32, tied embeddings. The routers are initialised so that their logits spread by about 1 (std
1/sqrt(hidden)): at HF's default std 0.02 the logits differ by ~0.1 and a top-2 choice is more often
a near-tie that float rounding decides, which neither a test of the capture nor a learning run wants.
"""

from __future__ import annotations

ROUTER_LOGIT_STD = 1.0
EXPERTS, TOP_K = 8, 2


def _common(vocab_size: int, eos_id: int, pad_id: int) -> dict:
    return dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
        pad_token_id=pad_id,
    )


def _decisive_routers(model, seed: int):
    """Router weights whose logits spread by ROUTER_LOGIT_STD (see the module doc): every `mlp.gate`."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.mlp.gate.weight
            w.copy_(torch.randn(w.shape, generator=g) * ROUTER_LOGIT_STD / w.shape[1] ** 0.5)
    return model.to(torch.float32)


def qwen3_moe(vocab_size: int, eos_id: int, pad_id: int, seed: int = 0):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**_common(vocab_size, eos_id, pad_id), head_dim=32, norm_topk_prob=True, dtype="float32")
    torch.manual_seed(seed)
    return _decisive_routers(Qwen3MoeForCausalLM(config), seed)


def qwen2_moe(vocab_size: int, eos_id: int, pad_id: int, seed: int = 0):
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        **_common(vocab_size, eos_id, pad_id), shared_expert_intermediate_size=64, norm_topk_prob=False, dtype="float32"
    )
    torch.manual_seed(seed)
    return _decisive_routers(Qwen2MoeForCausalLM(config), seed)
