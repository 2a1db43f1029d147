"""Micro-batches by token budget: the fewest micro-batches under the budget, none over it, balanced
(the largest within total / count + the longest sequence); the shards of data-parallel ranks balanced
by tokens (loads within one group of each other); `micro_batch_tokens: auto` from free memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen2Config

from async_rl.buffer.balance import balanced_shards, group_tokens
from async_rl.learner.packing import SeqSample, balanced, split
from async_rl.learner.shared_prefix import block_tokens, split_shared
from async_rl.learner.token_budget import CPU_BUDGET, resolve_budget
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


@pytest.mark.parametrize("world", [2, 3, 4])
def test_rank_shards_are_balanced_by_tokens_within_one_group(world):
    batch = groups(0, n_groups=12, group_size=4) + groups(1, n_groups=12, group_size=4)
    for i, g in enumerate(batch):  # a long tail: a few groups much longer than the rest
        g.completions = [np.zeros(int(5 + (i % 7) ** 3), np.int32) for _ in g.completions]
    shards = balanced_shards(batch, world)
    assert all(len(sh) == len(batch) // world for sh in shards)
    picked = [g for sh in shards for g in sh]
    assert len({id(g) for g in picked}) == len(picked)
    loads = [sum(group_tokens(g) for g in sh) for sh in shards]
    assert max(loads) - min(loads) <= max(group_tokens(g) for g in batch)
    contiguous = [sum(group_tokens(g) for g in batch[r * 24 // world : (r + 1) * 24 // world]) for r in range(world)]
    assert max(loads) - min(loads) <= max(contiguous) - min(contiguous)
    assert balanced_shards(batch, 1) == [batch]


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
