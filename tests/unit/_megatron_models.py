"""Tiny random-init HF models of the two families the Megatron backend converts (built offline)."""

from __future__ import annotations

import torch


def tiny_qwen2():
    from async_rl.models.tiny import build_model, build_tokenizer

    tok = build_tokenizer()
    return build_model(len(tok), tok.eos_token_id, tok.pad_token_id, seed=1)


def tiny_llama(tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=50,  # not a multiple of 4: TP=4 pads the vocabulary
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        rope_theta=500000.0,
    )
    torch.manual_seed(2)
    return LlamaForCausalLM(cfg).float()
