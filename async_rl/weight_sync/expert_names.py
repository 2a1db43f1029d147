"""A learner's fused expert tensors under the per-expert checkpoint names vLLM's `load_weights` expects.

transformers 5 keeps an MoE layer's experts fused: `...mlp.experts.gate_up_proj` [E, 2I, H] (each
expert's gate rows, then its up rows) and `...mlp.experts.down_proj` [E, H, I]; its `save_pretrained`
writes them back per expert, and vLLM's loaders read that checkpoint form
(`mlp.experts.{e}.gate_proj.weight`, ...; Mixtral: `block_sparse_moe.experts.{e}.w1/w3/w2.weight`).
vLLM 0.32 also takes the fused names without complaint, through a path written for EP and other
layouts; the receiver splits them here, as views (no copy), so the load goes through the checkpoint
path that vLLM's own start-up uses.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_GATE_UP, _DOWN = ".experts.gate_up_proj", ".experts.down_proj"
# model_type -> (the MoE block's checkpoint name, gate, up, down names of an expert)
_CHECKPOINT_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2")}
_DEFAULT_NAMES = ("mlp", "gate_proj", "up_proj", "down_proj")


def per_expert(named: Iterable[tuple[str, torch.Tensor]], model_type: str) -> Iterator[tuple[str, torch.Tensor]]:
    """`named` with every fused expert tensor split into its experts' checkpoint names."""
    block, gate, up, down = _CHECKPOINT_NAMES.get(model_type, _DEFAULT_NAMES)
    for name, t in named:
        if name.endswith(_GATE_UP) and t.dim() == 3:
            base = _block(name[: -len(_GATE_UP)], block)
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{base}.experts.{e}.{gate}.weight", t[e, :half]
                yield f"{base}.experts.{e}.{up}.weight", t[e, half:]
        elif name.endswith(_DOWN) and t.dim() == 3:
            base = _block(name[: -len(_DOWN)], block)
            for e in range(t.shape[0]):
                yield f"{base}.experts.{e}.{down}.weight", t[e]
        elif block != "mlp" and ".mlp.gate." in name:  # the router of a renamed block
            yield name.replace(".mlp.gate.", f".{block}.gate."), t
        else:
            yield name, t


def _block(prefix: str, block: str) -> str:
    """`model.layers.3.mlp` -> the checkpoint's block name (`model.layers.3.block_sparse_moe` for Mixtral)."""
    return prefix if block == "mlp" else prefix.rsplit(".", 1)[0] + f".{block}"
