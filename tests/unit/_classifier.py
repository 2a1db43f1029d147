"""A tiny random sequence-classification reward model with SmolLM2's tokenizer, built offline for tests
(unit: tests/unit/test_reward_models.py; integration: tests/integration/test_reward_models_real.py)."""

from __future__ import annotations

from pathlib import Path


def build_tiny_classifier(folder: Path, tokenizer_dir: Path, num_labels: int = 1, seed: int = 0) -> Path:
    """A 2-layer, 64-wide LlamaForSequenceClassification (random weights) saved with the tokenizer of
    `tokenizer_dir`; its config.json names the architecture as a real reward model's does."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024, num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(config)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder
