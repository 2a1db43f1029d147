"""Tiny random-init HF models of the two families the Megatron backend converts (built offline)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from async_rl.models.tiny_moe import TinyMoe, build


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


def megatron_copy(hf: torch.nn.Module):
    """(arch, a one-rank Megatron GPTModel holding `hf`'s weights); parallel state initialised."""
    from async_rl.learner.megatron import convert as mcv
    from async_rl.learner.megatron import model as mm

    arch = mcv.arch_from_hf_config(hf.config)
    torch.manual_seed(0)
    model = mm.build_model(arch, torch.float32, cpu_init=True, te_spec=False)
    mm.load_hf_weights(model, dict(hf.named_parameters()), arch, te_spec=False)
    return arch, model


def fixed_batch(vocab: int, seed: int = 5):
    """Two prompt groups of four completions with varied rewards (so GRPO advantages are non-zero)."""
    import numpy as np

    from async_rl.learner.megatron.batch import Collated
    from async_rl.protocol import REWARD_OK, TrajectoryGroup

    rng = np.random.default_rng(seed)
    groups = []
    for g in range(2):
        lens = [3, 5, 4, 6]
        groups.append(
            TrajectoryGroup(
                prompt_id=g,
                engine_id=0,
                prompt_tokens=rng.integers(3, vocab, size=4).astype(np.int32),
                completions=[rng.integers(3, vocab, size=n).astype(np.int32) for n in lens],
                logprobs=[np.zeros(n, dtype=np.float32) for n in lens],  # replaced by the policy's own below
                rewards=[1.0, 0.0, 0.5, 0.0],
                version_first=[0] * 4,
                version_last=[0] * 4,
                reward_status=[REWARD_OK] * 4,
            )
        )
    return Collated(groups)


def on_policy_loss(b) -> float:
    """PPO loss at ratio 1: -(token mean of the advantages) over the loss mask."""
    adv = b.advantages.expand_as(b.loss_mask)
    return float(-(adv * b.loss_mask).sum() / b.loss_mask.sum())


@contextlib.contextmanager
def one_rank_model_parallel() -> Iterator[None]:
    """A one-rank gloo group and Megatron's parallel state with TP=PP=1 (for a module fixture)."""
    from megatron.core import parallel_state

    from async_rl.cluster.net import free_port

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def tiny_qwen3():
    """A random dense Qwen3 (per-head q/k RMSNorms, no biases)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=50, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rope_theta=10000.0, tie_word_embeddings=False,
    )
    torch.manual_seed(5)
    return Qwen3ForCausalLM(cfg).float()


# The MoE models the Megatron tests convert (models/tiny_moe.py): head_dim 16, untied, routers' weights of
# std 0.5 (logits spread ~4) so the experts a token picks depend on it (transformers initialises them to zero)
MOE_VOCAB = 50
MOE_SHAPE = TinyMoe("qwen3_moe", hidden_size=64, heads=4, kv_heads=2, expert_width=32, dense_width=128,
                    max_positions=128, tie_embeddings=False, router_logit_std=4.0)


def tiny_qwen3_moe(norm_topk_prob: bool = True, experts: int = 8, seed: int = 3):
    """A random Qwen3-MoE (transformers' own class): 2 layers, 8 experts, top-2, per-head q/k norms."""
    return build(MOE_SHAPE._replace(experts=experts, norm_topk_prob=norm_topk_prob), MOE_VOCAB, seed=seed)


def tiny_qwen2_moe(seed: int = 4):
    """A random Qwen2-MoE: q/k/v biases, no top-k renormalisation, a shared expert with a sigmoid gate."""
    shape = MOE_SHAPE._replace(family="qwen2_moe", shared_width=48, norm_topk_prob=False)
    return build(shape, MOE_VOCAB, seed=seed)


def tiny_moe(kind: str):
    """The tiny MoE model of a family by its HF model_type (qwen3_moe, qwen2_moe)."""
    return {"qwen3_moe": tiny_qwen3_moe, "qwen2_moe": tiny_qwen2_moe}[kind]()


@contextlib.contextmanager
def hf_routes(model: torch.nn.Module, forced: torch.Tensor | None = None) -> Iterator[list[torch.Tensor]]:
    """Inside: every forward of the HF MoE `model` appends its routers' choices, long [tokens, layers,
    k] (tokens row-major over [B, T]), to the yielded list. `forced` (long [tokens, layers, k]): the
    routers run those experts instead, their weights gathered from the router's own softmax (and
    renormalised where the model renormalises): the HF side of a replay."""
    gates = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    seen: list[list[torch.Tensor]] = [[] for _ in gates]
    out: list[torch.Tensor] = []

    def hook(layer: int):
        def record(module, _inputs, output):
            logits, scores, indices = output
            if forced is not None:
                indices = forced[:, layer].to(indices.device)
                probs = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, indices)
                if module.norm_topk_prob:
                    probs = probs / probs.sum(dim=-1, keepdim=True)
                scores = probs.to(logits.dtype)
            seen[layer].append(indices.detach())
            return logits, scores, indices

        return record

    handles = [g.register_forward_hook(hook(i)) for i, g in enumerate(gates)]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()
        if seen[0]:
            out.extend(torch.stack([s[i] for s in seen], dim=1) for i in range(len(seen[0])))
