"""Micro-batches by token budget: the fewest micro-batches under the budget, none over it, balanced
(the largest within total / count + the longest sequence); the shards of data-parallel ranks balanced
by tokens (loads within one group of each other); `micro_batch_tokens: auto` from free memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen2Config

from async_rl.buffer.balance import balanced_shards, group_cost
from async_rl.learner.batch.packing import SeqSample, balanced, split
from async_rl.learner.batch.shared_prefix import block_tokens, split_shared
from async_rl.learner.batch.token_budget import CPU_BUDGET, activation_bytes_per_token, resolve_budget
from async_rl.models.cost import CostModel
from async_rl.models.shape import ModelShape
from tests.unit._learner_fixtures import groups


def samples(rng: np.random.Generator, n_prompts: int, group: int) -> list[SeqSample]:
    out = []
    for _ in range(n_prompts):
        prompt = rng.integers(3, 100, size=int(rng.integers(20, 60)))
        for _ in range(group):
            comp = rng.integers(3, 100, size=int(np.clip(rng.lognormal(np.log(60), 0.8), 1, 300)))
            n = len(comp)
            out.append(SeqSample(np.concatenate([prompt, comp]), len(prompt), np.zeros(n, np.float32),
                                 np.zeros(n, np.float32)))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [400, 1000, 3000])
def test_micro_batches_are_fewest_under_the_budget_and_balanced(seed, budget):
    s = samples(np.random.default_rng(seed), 8, 4)
    greedy, chunks = split(s, 0, budget), balanced(split, s, 0, budget)
    assert [x for c in chunks for x in c] == s  # every sequence once, in order
    assert len(chunks) == len(greedy)  # as few as the greedy cut
    sizes = [sum(len(x.tokens) for x in c) for c in chunks]
    longest = max(len(x.tokens) for x in s)
    assert all(n <= budget or len(c) == 1 for n, c in zip(sizes, chunks, strict=True))
    assert max(sizes) <= sum(sizes) / len(chunks) + longest  # the stated bound
    assert max(sizes) <= max(sum(len(x.tokens) for x in c) for c in greedy)


@pytest.mark.parametrize("seed", range(4))
def test_shared_prompt_micro_batches_stay_under_the_budget(seed):
    s = samples(np.random.default_rng(seed), 8, 4)
    greedy, chunks = split_shared(s, 0, 700), balanced(split_shared, s, 0, 700)
    assert [x for c in chunks for x in c] == s and len(chunks) == len(greedy)
    sizes = [block_tokens(c) for c in chunks]
    assert max(sizes) <= 700 and max(sizes) <= max(block_tokens(c) for c in greedy)


def tokens(g) -> float:
    """Tokens the learner runs for a group (its cost without attention's quadratic share)."""
    return group_cost(g)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_rank_shards_are_balanced_by_tokens_within_one_group(world):
    batch = groups(0, n_groups=12, group_size=4) + groups(1, n_groups=12, group_size=4)
    for i, g in enumerate(batch):  # a long tail: a few groups much longer than the rest
        g.completions = [np.zeros(int(5 + (i % 7) ** 3), np.int32) for _ in g.completions]
    shards = balanced_shards(batch, world)
    assert all(len(sh) == len(batch) // world for sh in shards)
    picked = [g for sh in shards for g in sh]
    assert len({id(g) for g in picked}) == len(picked)
    loads = [sum(tokens(g) for g in sh) for sh in shards]
    assert max(loads) - min(loads) <= max(tokens(g) for g in batch)
    contiguous = [sum(tokens(g) for g in batch[r * 24 // world : (r + 1) * 24 // world]) for r in range(world)]
    assert max(loads) - min(loads) <= max(contiguous) - min(contiguous)
    assert balanced_shards(batch, 1) == [batch]


def one_group(prompt: int, completions: list[int]):
    g = groups(0, n_groups=1, group_size=len(completions))[0]
    g.prompt_tokens = np.zeros(prompt, np.int32)
    g.completions = [np.zeros(n, np.int32) for n in completions]
    return g


def test_rank_shards_weigh_attention_s_quadratic_cost():
    # Equal tokens, unequal attention: one 4000-token sample against four of 1000 (same for 3000/3x1000).
    batch = [one_group(0, [4000]), one_group(0, [1000] * 4), one_group(0, [3000]), one_group(0, [1000] * 3)]
    cost = CostModel(attention_weight=1e-2)  # flash: attention dominates, a 1000-token sequence costs 1000 + 5000

    def worst(shards):
        return max(sum(group_cost(g, cost) for g in sh) for sh in shards)

    by_tokens, by_flops = balanced_shards(batch, 2), balanced_shards(batch, 2, cost)
    assert sorted(len(sh) for sh in by_flops) == [2, 2]
    assert {id(g) for sh in by_flops for g in sh} == {id(g) for g in batch}
    # By tokens: {4000, 3000} beside the short samples (7000 tokens each), costs 132,000 against 42,000;
    # by FLOPs the long ones go to different ranks: {4000, 3x1000} and {4x1000, 3000}.
    assert [len(sh[0].completions) for sh in by_tokens] == [1, 4] and worst(by_flops) < 0.8 * worst(by_tokens)
    assert [[len(g.completions) for g in sh] for sh in by_flops] == [[1, 3], [4, 1]]
    assert group_cost(batch[0]) == 4000  # the default: tokens


def test_attention_weight_from_the_model_shape(tmp_path):
    (tmp_path / "config.json").write_text(QWEN_05B.to_json_string())
    shape = ModelShape.read(tmp_path)
    assert shape is not None and shape.num_key_value_heads == 2
    assert shape.attention_weight() == pytest.approx(8.7e-5, rel=0.03)
    flash = CostModel(attention_weight=shape.attention_weight(), path="flash")
    share = {n: 1 - n / flash.sample(n) for n in (712, 8192)}
    assert share[712] == pytest.approx(0.03, abs=0.005) and share[8192] == pytest.approx(0.26, abs=0.01)
    assert ModelShape.read(tmp_path / "absent") is None


QWEN_05B = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2)


def test_auto_budget_from_free_memory():
    kw = dict(config=QWEN_05B, trainable_params=494_000_000, compute_bytes=2, checkpointing=False, chunk=1024)
    cuda = torch.device("cuda", 0)
    b = resolve_budget("auto", device=cuda, available_bytes=70 * 2**30, **kw)
    assert b.tokens % 1024 == 0 and 8192 <= b.tokens <= 262144
    assert "\n" not in b.line and "per token" in b.line and str(b.tokens) in b.line
    assert resolve_budget("auto", device=cuda, available_bytes=30 * 2**30, **kw).tokens < b.tokens
    more = resolve_budget("auto", device=cuda, available_bytes=30 * 2**30, **{**kw, "checkpointing": True})
    assert more.tokens > resolve_budget("auto", device=cuda, available_bytes=30 * 2**30, **kw).tokens
    assert resolve_budget("auto", device=torch.device("cpu"), **kw).tokens == CPU_BUDGET
    assert resolve_budget(4096, device=cuda, **kw).tokens == 4096


def test_auto_budget_counts_the_sequence_parallel_group():
    """learner.sequence_parallel_size: each rank holds 1 / SP of a micro-batch's activations, so the
    micro-batch may hold SP times one rank's budget (and the line says so)."""
    kw = dict(config=QWEN_05B, trainable_params=494_000_000, compute_bytes=2, checkpointing=False, chunk=1024)
    cuda = torch.device("cuda", 0)
    one = resolve_budget("auto", device=cuda, available_bytes=70 * 2**30, **kw)
    four = resolve_budget("auto", device=cuda, available_bytes=70 * 2**30, sequence_parallel=4, **kw)
    assert four.tokens == 4 * one.tokens and "x sequence_parallel_size 4" in four.line
    assert resolve_budget("auto", device=torch.device("cpu"), sequence_parallel=2, **kw).tokens == 2 * CPU_BUDGET
    assert resolve_budget(4096, device=cuda, sequence_parallel=2, **kw).tokens == 4096  # a number is the micro-batch's


def test_kept_logits_are_counted_per_token():
    """learner.logprob_keep_logits: vocabulary x compute bytes more per token (297 KiB for Qwen2.5 in
    bf16), so the same memory holds fewer tokens, and the line says what they cost."""
    kw = dict(config=QWEN_05B, trainable_params=494_000_000, compute_bytes=2, checkpointing=False, chunk=1024,
              device=torch.device("cuda", 0), available_bytes=70 * 2**30)
    plain, kept = resolve_budget("auto", **kw), resolve_budget("auto", keeps_logits=True, **kw)
    room = 70 * 2**30 - 494_000_000 * 12 - 3 * 1024 * 151936 * 4  # less gradients + AdamW, the head's chunk
    activations = activation_bytes_per_token(ModelShape.of(QWEN_05B), 2, False)
    assert plain.tokens == room // activations // 1024 * 1024
    assert kept.tokens == room // (activations + 151936 * 2) // 1024 * 1024 < plain.tokens
    assert "0.29 MiB of kept logits" in kept.line and "kept logits" not in plain.line


def test_the_activation_cost_reads_the_model_shape(tmp_path):
    """A loaded HF config and its config.json give one shape; the per-token cost counts its layers
    (8h + 4 kv + 4 I elements each, x2 bytes, x MARGIN); a config without the MLP width is refused in
    one line."""
    from async_rl.learner.batch.token_budget import MARGIN, activation_bytes_per_token

    (tmp_path / "config.json").write_text(QWEN_05B.to_json_string())
    shape = ModelShape.of(QWEN_05B)
    assert shape == ModelShape.read(tmp_path) and shape.kv_size() == 128
    per_layer = 8 * 896 + 4 * 128 + 4 * 4864
    assert activation_bytes_per_token(shape, 2, False) == int(24 * per_layer * 2 * MARGIN)
    assert activation_bytes_per_token(shape, 2, True) == int((24 * 896 + per_layer) * 2 * MARGIN)
    with pytest.raises(ValueError, match="not a Llama/Qwen2-style decoder's: Object missing required field `num_hidden_layers`"):
        ModelShape.of(type("Config", (), {"to_dict": lambda self: {"hidden_size": 8}})())
