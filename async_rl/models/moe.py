"""What a mixture-of-experts model's config.json says about its routing: experts, top-k and which
layers route (the columns of a sample's routes, protocol.ROUTE_DTYPES). Read without transformers."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from async_rl.protocol import RouteLayout, route_dtype


class MoeRouting(msgspec.Struct, frozen=True):
    num_experts: int  # routed experts per MoE layer (a shared expert is not routed)
    top_k: int
    moe_layers: list[int]  # layer indices whose MLP is a routed MoE, in order
    num_layers: int

    def layout(self) -> RouteLayout:
        """The routes layout every frame of this model carries."""
        return RouteLayout(len(self.moe_layers), self.top_k, route_dtype(self.num_experts).itemsize)


def read_routing(model_dir: str | Path) -> MoeRouting | None:
    """The routing of the model in `model_dir`; None for a dense model (or no readable config.json)."""
    try:
        c = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    c = c.get("text_config", c)
    experts = int(c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0)
    top_k = int(c.get("num_experts_per_tok") or 0)
    layers = int(c.get("num_hidden_layers") or 0)
    if experts <= 0 or top_k <= 0 or layers <= 0:
        return None
    # Qwen2/3-MoE: every `decoder_sparse_step`-th layer, except `mlp_only_layers`; DeepSeek-style:
    # the first `first_k_dense_replace` are dense. Mixtral, OLMoE: every layer.
    step = int(c.get("decoder_sparse_step") or 1)
    dense = set(c.get("mlp_only_layers") or []) | set(range(int(c.get("first_k_dense_replace") or 0)))
    moe = [i for i in range(layers) if (i + 1) % step == 0 and i not in dense]
    return MoeRouting(num_experts=experts, top_k=top_k, moe_layers=moe, num_layers=layers)
