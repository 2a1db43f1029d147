"""A decoder's shape, read from its Hugging Face config.json, and what its FLOPs say about balancing.

A sequence of L tokens costs the learner about L x (the FLOPs of every matmul per token) plus, in
attention, L^2 / 2 query-key pairs (causal) x (4 x hidden x layers FLOPs per pair: QK^T and AV). So
relative to one token's matmuls a sequence costs `L + attention_weight x L^2 / 2`, where
`attention_weight = 4 x hidden x layers / (2 x matmul parameters)`. For Qwen2.5-0.5B that is 8.7e-5:
attention adds 3% to a 712-token sequence's matmul FLOPs and 36% to an 8192-token one's under a causal
kernel that skips the masked half (flash); what each attention path computes is `models/cost.py`.
"""

from __future__ import annotations

from pathlib import Path

import msgspec


class ModelShape(msgspec.Struct, frozen=True, kw_only=True):
    """The fields of a Llama/Qwen2/Mistral-style config.json that set its FLOPs."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # absent: as many as the query heads (no GQA)

    @classmethod
    def read(cls, model_dir: str | Path) -> ModelShape | None:
        """The shape in `model_dir`/config.json; None where it is not a decoder of this kind."""
        path = Path(model_dir) / "config.json"
        try:
            return msgspec.json.decode(path.read_bytes(), type=cls)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return None

    @classmethod
    def of(cls, config: object) -> ModelShape:
        """The shape of a loaded Hugging Face config (`PretrainedConfig`); ValueError naming what is
        missing where it is not a decoder of this kind."""
        try:
            return msgspec.convert(config.to_dict(), type=cls)  # type: ignore[attr-defined]
        except msgspec.ValidationError as e:
            raise ValueError(f"the model's config is not a Llama/Qwen2-style decoder's: {e}") from None

    def kv_size(self) -> int:
        """Width of the key (and of the value) projection: KV heads x head size."""
        kv_heads = self.num_key_value_heads or self.num_attention_heads
        return self.hidden_size * kv_heads // self.num_attention_heads

    def matmul_parameters(self) -> int:
        """Parameters every token multiplies by: the layers' projections (gated MLP) and the head."""
        h, kv = self.hidden_size, self.kv_size()
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * self.intermediate_size
        return self.num_hidden_layers * per_layer + h * self.vocab_size

    def attention_weight(self) -> float:
        """FLOPs of one query-key pair over one token's matmul FLOPs (see the module's docstring)."""
        return 4 * self.hidden_size * self.num_hidden_layers / (2 * self.matmul_parameters())
