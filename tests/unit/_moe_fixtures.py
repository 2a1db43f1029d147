"""Tiny MoE model folders for learner tests (Qwen3-MoE; Qwen2-MoE with its shared expert; Mixtral, the
upcycled smollm2-135m-moe preset's class), and routes made
by running the model itself: what an engine would record, or perturbed routes to prove replay is obeyed."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

from async_rl.learner.model.moe import routers
from async_rl.protocol import TrajectoryGroup, route_dtype, route_missing

# 2 layers, 8 experts, top-2: the tiny MoE (head_dim 32: the CPU engine's minimum)
COMMON = dict(
    vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, num_experts=8, num_experts_per_tok=2,
    max_position_embeddings=256, tie_word_embeddings=True,
)


def build_moe_dir(family: str, out: Path, tokenizer_from: Path) -> Path:
    """A random `family` ('qwen3_moe', 'qwen2_moe' or 'mixtral') model saved in `out`, with the tiny preset's
    tokenizer files (its ids are below the vocabulary size here)."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    if family == "qwen3_moe":
        config = Qwen3MoeConfig(**COMMON, head_dim=32, norm_topk_prob=True)
    elif family == "qwen2_moe":  # a shared expert beside the routed ones, no top-k renormalisation
        config = Qwen2MoeConfig(**COMMON, shared_expert_intermediate_size=64, norm_topk_prob=False)
    elif family == "mixtral":  # Llama's attention, always-renormalised top-k, experts of intermediate_size
        shape = {k: v for k, v in COMMON.items() if k not in ("num_experts", "moe_intermediate_size", "intermediate_size")}
        config = MixtralConfig(**shape, num_local_experts=COMMON["num_experts"], intermediate_size=32, head_dim=32)
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # routers initialised wider than HF's 0.02, so routing depends on the token
        for r in routers(model):
            r.weight.normal_(0.0, 0.5)
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
