"""Tiny MoE model folders for learner tests (Qwen3-MoE; Qwen2-MoE with its shared expert; Mixtral, the
upcycled smollm2-135m-moe preset's class), and routes made
by running the model itself: what an engine would record, or perturbed routes to prove replay is obeyed."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

from async_rl.learner.model.moe import routers
from async_rl.models.tiny_moe import TinyMoe, build
from async_rl.protocol import TrajectoryGroup, route_dtype, route_missing

# 2 layers, 8 experts, top-2: the tiny MoE (head_dim 32: the CPU engine's minimum), narrower than
# the presets; routers' weights of std 0.5 (logits spread ~4), so routing depends on the token
VOCAB = 64
SHAPE = TinyMoe("qwen3_moe", hidden_size=64, heads=2, kv_heads=1, expert_width=32, dense_width=128,
                max_positions=256, router_logit_std=4.0)
FAMILIES = {
    "qwen3_moe": SHAPE,
    "qwen2_moe": SHAPE._replace(family="qwen2_moe", shared_width=64, norm_topk_prob=False),  # a shared expert
    "mixtral": SHAPE._replace(family="mixtral"),  # Llama's attention, always-renormalised top-k
}


def build_moe_dir(family: str, out: Path, tokenizer_from: Path) -> Path:
    """A random `family` ('qwen3_moe', 'qwen2_moe' or 'mixtral') model saved in `out`, with the tiny preset's
    tokenizer files (its ids are below the vocabulary size here)."""
    model = build(FAMILIES[family], VOCAB)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for f in tokenizer_from.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out


def live_routes(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    """The model's own routing of `tokens` (one unpadded sequence, no replay) as the contract's array:
    [len - 1, moe_layers, top_k] in the routes dtype (the last token's row left out)."""
    found = routers(model)
    seen: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda m, a, out: seen.append(out[2].detach().clone())) for r in found]
    try:
        with torch.no_grad():
            model(input_ids=torch.as_tensor(tokens, dtype=torch.long)[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return torch.stack(seen, dim=1).numpy()[:-1].astype(route_dtype(found[0].num_experts))


def with_routes(model: torch.nn.Module, gs: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
    """`gs` with the routes the model itself chooses for every sample (what an engine on the same
    weights records)."""
    for g in gs:
        g.routes = [live_routes(model, np.concatenate([g.prompt_tokens, c])) for c in g.completions]
    return gs


def random_routes(gs: list[TrajectoryGroup], layers: int, top_k: int, experts: int, seed: int,
                  missing_every: int = 0) -> list[TrajectoryGroup]:
    """`gs` with random valid routes (distinct experts per row, unlike what the model would choose); every
    `missing_every`-th row all `route_missing` (0: none). A group's samples share their prompt's rows."""
    rng = np.random.default_rng(seed)
    dtype = route_dtype(experts)
    for g in gs:
        p = len(g.prompt_tokens)
        prompt = np.stack([np.stack([rng.permutation(experts)[:top_k] for _ in range(layers)]) for _ in range(p)])
        g.routes = []
        for c in g.completions:
            rows = np.stack([np.stack([rng.permutation(experts)[:top_k] for _ in range(layers)])
                             for _ in range(len(c) - 1)]) if len(c) > 1 else np.zeros((0, layers, top_k))
            r = np.concatenate([prompt, rows]).astype(dtype)
            if missing_every:
                r[::missing_every] = route_missing(dtype)
            g.routes.append(r)
    return gs


def experts_calls(model: torch.nn.Module) -> tuple[list[tuple[int, torch.Tensor]], list]:
    """A list filled with (MoE layer, the top-k indices the experts ran) per experts call, and the hooks."""
    calls: list[tuple[int, torch.Tensor]] = []
    gates = {id(r): i for i, r in enumerate(routers(model))}
    blocks = [(gates[id(m.gate)], m.experts) for m in model.modules() if id(getattr(m, "gate", None)) in gates]
    handles = [
        experts.register_forward_pre_hook(lambda mod, args, layer=layer: calls.append((layer, args[1].detach().clone())))
        for layer, experts in blocks
    ]
    return calls, handles


def disagree_by_layer(gs: list[TrajectoryGroup], experts: int) -> list[TrajectoryGroup]:
    """`gs` (carrying the model's own routes, `with_routes`) with other experts recorded in layer 0 on every
    2nd row and in layer 1 on every 3rd: a token agrees in layer 0, in layer 1 and in both on different
    rows, so the all-layer agreement is neither layer's alone. The replacement is the first `top_k`
    experts the row does not name (another set)."""
    for g in gs:
        for r in g.routes:
            for layer, every in ((0, 2), (1, 3)):
                for row in range(0, len(r), every):
                    r[row, layer] = [e for e in range(experts) if e not in set(r[row, layer].tolist())][: r.shape[2]]
    return gs
