"""The learner's cost estimate per attention path (`models/cost.py`), micro-batches cut by it
(`packing.cost_cut`) and the ranks dealt by it (`buffer/balance.py`).

What a path computes was measured once (the module's docstring); here: each path's formula on layouts
whose pairs are known by hand, the layouts the cost reads without building a micro-batch equal the ones
the builders make, the cut keeps every sample once and in order and leaves similar lengths alone, and a
whole learner step on the cost cut equals the token cut's (loss, log-probs, gradients), and so do the
KL reference pass and the PPO critic's (reference log-probs, values, value loss, the critic's gradients),
which cut their micro-batches the same way (`batch/cut.py`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from async_rl.buffer.balance import balanced_shards, group_cost
from async_rl.config import AlgorithmConfig
from async_rl.learner.batch.cut import MicroBatchCut
from async_rl.learner.batch.packing import (
    SeqSample,
    balanced,
    chunk_cost,
    cost_cut,
    cut,
    micro_batches,
    packed,
    packed_layout,
    padded,
    padded_layout,
    split,
)
from async_rl.learner.batch.padded import PaddedShard
from async_rl.learner.batch.shared_prefix import shared, shared_layout, shared_micro_batches
from async_rl.learner.driver import shard_samples
from async_rl.models.cost import TOKENS, CostModel, Layout, deal, path_of
from async_rl.protocol import SCHEMA_VERSION, BatchRequest, decode_request, encode_request
from tests.unit._learner_fixtures import assert_equal_steps, groups, make_rank, spied_step


def sample(n: int, start: int = 3, prompt: np.ndarray | None = None, seed: int = 0) -> SeqSample:
    tokens = np.random.default_rng(seed + n).integers(3, 40, n)
    if prompt is not None:
        tokens[: len(prompt)] = prompt
    return SeqSample(tokens=tokens, start=start, behav_logp=np.zeros(n - start, np.float32),
                     advantages=np.ones(n - start, np.float32))


def test_paths_of_the_kernels():
    assert path_of("sdpa", "cpu") == path_of("sdpa", "cuda") == "dense"
    assert path_of("varlen", "cuda") == path_of("flex", "cuda") == "flash"
    assert path_of("varlen", "cpu") == "segments"  # attention.reference_varlen


def test_each_path_counts_the_pairs_its_kernel_computes():
    w = 0.01
    two_packed = Layout(1, 100, [(60, 0), (40, 0)])  # one row, two sequences: a mask under SDPA
    assert CostModel(attention_weight=w, path="dense").layout(two_packed) == 100 + w * 100 * 100
    assert CostModel(attention_weight=w, path="flash").layout(two_packed) == 100 + w * (60 * 60 + 40 * 40) / 2
    assert CostModel(attention_weight=w, path="segments").layout(two_packed) == 100 + w * (60 * 60 + 40 * 40)
    alone = Layout(2, 100, [(100, 0), (100, 0)])  # a sequence per row: HF passes no mask, SDPA runs causal
    assert CostModel(attention_weight=w, path="dense").layout(alone) == 200 + w * 2 * 100 * 100 / 2
    # a suffix of 30 reading a shared prefix of 50: flash reads the prefix whole, its own keys causally
    prefix = Layout(1, 80, [(50, 0), (30, 50)])
    assert CostModel(attention_weight=w, path="flash").pairs(prefix) == 50 * 50 / 2 + 30 * 50 + 30 * 30 / 2
    assert CostModel(attention_weight=w, path="segments").pairs(prefix) == 50 * 50 + 30 * 80
    assert CostModel(attention_weight=w, path="dense").pairs(prefix) == 80 * 80  # the dense block mask
    assert TOKENS.layout(prefix) == 80 and TOKENS.sample(123) == 123


def test_a_sample_s_share_before_the_cut():
    dense = CostModel(attention_weight=0.01, path="dense", row_tokens=256)
    assert dense.sample(100) == 100 * (1 + 0.01 * 256)  # a masked row of 256 shared with others
    assert dense.sample(1000) == 1000 + 0.01 * 1000 * 1000 / 2  # a row of its own, cut off: causal
    assert CostModel(attention_weight=0.01, path="flash").sample(1000) == 1000 + 0.01 * 1000 * 1000 / 2
    assert CostModel(attention_weight=0.01, path="segments").sample(1000) == 1000 + 0.01 * 1000 * 1000


@pytest.mark.parametrize("row_tokens", [0, 16, 40])
def test_the_estimated_layout_is_the_built_one(row_tokens):
    lengths = [7, 12, 30, 5, 9, 22, 3]
    samples = [sample(n) for n in lengths]
    assert packed_layout(lengths, row_tokens) == packed(samples, row_tokens).segments.layout()
    assert padded_layout(lengths) == padded(samples).segments.layout()
    prompt = np.arange(3, 9)
    runs = [sample(n, start=6, prompt=prompt, seed=1) for n in (10, 14, 8)] + [sample(n, seed=2) for n in (9, 25)]
    for pack in (True, False):
        assert shared_layout(runs, row_tokens, pack) == shared(runs, row_tokens, pack).segments.layout()


def long_tailed(n_short: int = 24, long_at: int = 10) -> list[SeqSample]:
    lengths = [int(x) for x in np.random.default_rng(0).integers(10, 30, n_short)]
    lengths[long_at] = 400
    return [sample(n, seed=i) for i, n in enumerate(lengths)]


def test_the_cut_isolates_the_long_sample_once_and_in_order():
    samples = long_tailed()
    dense = CostModel(attention_weight=3e-3, path="dense", row_tokens=64)
    of = chunk_cost(dense, True, 64)
    token_cut = balanced(split, samples, 0, 8192)
    assert len(token_cut) == 1
    chunks = cost_cut(token_cut, of)
    assert [s for c in chunks for s in c] == samples  # every sample once, in order
    assert [len(c) for c in chunks] == [10, 1, 13]  # the 400-token sample alone
    assert sum(of(c) for c in chunks) < 0.5 * of(samples)  # its width no longer sets the short rows'
    # the micro-batches built on the cut
    mbs = micro_batches(samples, True, 0, 8192, 64, dense)
    assert [len(mb.spans) for mb in mbs] == [10, 1, 13] and [mb.input_ids.shape[1] for mb in mbs] == [64, 400, 64]


def test_the_cut_finds_every_long_sample():
    """A chunk that starts with a long sample and holds a second one: cutting off the first alone saves
    little (the second keeps the rest wide), the pieces cut again save most: every long sample alone."""
    lengths = [400] + [20] * 12 + [380] + [20] * 12
    samples = [sample(n, seed=i) for i, n in enumerate(lengths)]
    dense = CostModel(attention_weight=3e-3, path="dense", row_tokens=64)
    of = chunk_cost(dense, True, 64)
    chunks = cost_cut([samples], of)
    assert [len(c) for c in chunks] == [1, 12, 1, 12] and [s for c in chunks for s in c] == samples
    assert sum(of(c) for c in chunks) < 0.5 * of(samples)
    # the KL reference's padded rows the same way
    rows = MicroBatchCut(cost=dense, max_tokens=8192).padded_rows(lengths, "dense")
    assert [len(r) for r in rows] == [1, 12, 1, 12]


def test_similar_lengths_keep_the_token_cut():
    samples = [sample(int(n), seed=i) for i, n in enumerate(np.random.default_rng(1).integers(10, 30, 60))]
    token_cut = balanced(split, samples, 0, 300)
    for path in ("dense", "flash", "segments"):
        for row_tokens in (0, 64):
            model = CostModel(attention_weight=3e-3, path=path, row_tokens=row_tokens)
            assert cost_cut(token_cut, chunk_cost(model, True, row_tokens)) == token_cut


def test_flash_leaves_a_long_sample_in_full_rows():
    # varlen on CUDA: a long sample costs the same in or out of its micro-batch when rows are full
    samples = [sample(40, seed=i) for i in range(10)] + [sample(400)] + [sample(40, seed=i) for i in range(10, 20)]
    flash = CostModel(attention_weight=3e-3, path="flash")
    assert packed_layout([len(s.tokens) for s in samples]).rows == 3  # 400 + 400 + 400 positions, no padding
    assert cost_cut([samples], chunk_cost(flash, True, 0)) == [samples]
    dense = CostModel(attention_weight=3e-3, path="dense")  # the same rows masked: the width's square each
    assert len(cost_cut([samples], chunk_cost(dense, True, 0))) == 3


def test_shared_prompt_micro_batches_are_cut_by_cost_too():
    prompt = np.arange(3, 9)
    samples = [sample(n, start=6, prompt=prompt, seed=i) for i, n in enumerate([12, 15, 11, 14, 300, 13, 12, 16])]
    dense = CostModel(attention_weight=3e-3, path="dense", row_tokens=48)
    mbs = shared_micro_batches(samples, True, 0, 8192, 48, dense)
    assert [len(mb.spans) for mb in mbs] == [4, 1, 3]
    assert len(shared_micro_batches(samples, True, 0, 8192, 48)) == 1


def long_tailed_groups():
    gs = groups(3, n_groups=4, group_size=4)
    g = gs[1]
    g.completions[2] = np.random.default_rng(0).integers(3, 40, 220).astype(np.int32)
    g.logprobs[2] = np.full(220, -3.0, np.float32)
    return gs


@pytest.mark.parametrize("share_prompt", [False, True])
def test_a_step_on_the_cost_cut_equals_the_token_cut(model_dir, share_prompt):
    """The loss is a sum over samples whatever the cut: the same log-probs, loss and gradients (a prompt
    run cut in two gets a prefix copy per piece)."""
    gs = long_tailed_groups()
    by_cost = make_rank(model_dir, pack_row_tokens=32, share_prompt=share_prompt)
    assert by_cost.cut.cost.path == "dense" and by_cost.cut.cost.attention_weight > 0  # SDPA on CPU
    by_tokens = make_rank(model_dir, by_cost=False, pack_row_tokens=32, share_prompt=share_prompt)  # tokens alone
    a, b = spied_step(by_tokens, gs), spied_step(by_cost, gs)
    assert a["micro_batches"] == 1 and b["micro_batches"] > 1
    widest = max(b["mbs"], key=lambda mb: mb.input_ids.shape[1])
    assert widest.input_ids.shape[1] > 220 and len(widest.spans) == 1  # the long sample alone
    assert_equal_steps(a, b)
    assert b["metrics"].loss == pytest.approx(a["metrics"].loss, abs=1e-6)


def test_padded_rows_are_cut_as_the_samples_are():
    """The KL reference pass's rows of a padded shard (indices) get the samples' cut: by tokens, then by the
    cost of padded rows on the path given."""
    samples = long_tailed()
    lengths = [len(s.tokens) for s in samples]
    at = {id(s): i for i, s in enumerate(samples)}
    model = CostModel(attention_weight=3e-3, path="flash", row_tokens=64)  # the pass gives its own path
    for cost, budget in ((None, 300), (model, 300), (model, 8192)):
        rows = MicroBatchCut(cost=cost, pack=True, max_tokens=budget).padded_rows(lengths, "dense")
        as_dense = None if cost is None else chunk_cost(CostModel(attention_weight=3e-3, path="dense"), False, 0)
        want = cut(split, samples, 0, budget, as_dense)
        assert rows == [[at[id(s)] for s in c] for c in want]
    alone = MicroBatchCut(cost=model, max_tokens=8192).padded_rows(lengths, "dense")
    assert [len(r) for r in alone] == [10, 1, 13] and alone[1] == [10]  # the 400-token row alone
    assert len(MicroBatchCut(cost=None, max_tokens=8192).padded_rows(lengths, "dense")) == 1
    similar = [int(n) for n in np.random.default_rng(1).integers(10, 30, 60)]
    for path in ("dense", "flash", "segments"):  # similar lengths keep the token cut
        c = MicroBatchCut(cost=model, max_tokens=300)
        assert c.padded_rows(similar, path) == MicroBatchCut(cost=None, max_tokens=300).padded_rows(similar, "dense")


def _forward_shapes(model) -> tuple[list[tuple[int, int]], object]:
    """The [rows, width] of every forward of `model`'s trunk (the head runs on its output), and the hook."""
    seen: list[tuple[int, int]] = []
    hook = model.base_model.register_forward_pre_hook(
        lambda _m, _args, kwargs: seen.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    return seen, hook


def test_the_kl_reference_pass_on_the_cost_cut_equals_the_token_cut(model_dir):
    gs = long_tailed_groups()
    shard = PaddedShard(gs)
    scored, shapes = {}, {}
    for by_cost in (False, True):
        rank = make_rank(model_dir, by_cost=by_cost, pack_row_tokens=32, algorithm=AlgorithmConfig(kl_coef=0.1))
        ref = rank.algo.reference
        assert ref.cut.cost == rank.cut.cost and ref.cut.max_tokens == rank.cut.max_tokens  # the driver's cut
        shapes[by_cost], hook = _forward_shapes(ref.model)
        scored[by_cost] = ref.score(shard, 0.9)
        hook.remove()
    assert len(shapes[False]) == 1  # by tokens: one micro-batch, every row as wide as the long sample
    longest = max(w for _, w in shapes[False])
    assert longest > 220 and len(shapes[True]) > 1
    # by cost (dense: SDPA under the padding mask): the long sample alone, the short rows narrow
    assert [(r, w) for r, w in shapes[True] if w == longest] == [(1, longest)]
    assert all(w < 40 for r, w in shapes[True] if w != longest)
    mask = shard.loss_mask
    torch.testing.assert_close(scored[True], scored[False], atol=1e-5, rtol=0)
    assert torch.all(scored[True][mask != 0] < 0) and torch.all(scored[True][mask == 0] == 0)


def _spied_critic(rank) -> dict:
    """Spies on ppo's critic: the values it predicts, its loss and its gradients (after clipping) per update,
    and the [rows, width] and span count of every micro-batch of the scoring pass it reads hidden states from."""
    out: dict = {"values": [], "loss": [], "grads": [], "hidden_mbs": []}
    critic, backend = rank.algo.critic, rank.backend
    real_values, real_update, real_score = critic.values, critic.update, backend.score

    def values(hidden):
        v = real_values(hidden)
        out["values"].append(v.clone())
        return v

    def update(hidden, returns, mask):
        out["loss"].append(real_update(hidden, returns, mask))
        out["grads"].append([p.grad.clone() for p in critic.head.parameters()])
        return out["loss"][-1]

    def score(mb, temperature, **kw):
        if kw.get("hidden"):
            out["hidden_mbs"].append((tuple(mb.input_ids.shape), len(mb.spans)))
        return real_score(mb, temperature, **kw)

    critic.values, critic.update, backend.score = values, update, score
    return out


def test_the_ppo_critic_on_the_cost_cut_equals_the_token_cut(model_dir):
    """Two steps (the second's values come from a trained head): values, value loss and the critic's
    gradients equal; the hidden states it reads come from micro-batches cut by cost."""
    gs = long_tailed_groups()
    spies, metrics = {}, {}
    for by_cost in (False, True):
        rank = make_rank(model_dir, by_cost=by_cost, pack_row_tokens=32, algorithm=AlgorithmConfig(name="ppo"))
        spies[by_cost] = _spied_critic(rank)
        metrics[by_cost] = [rank.train_on_shard(step, gs) for step in range(2)]
    a, b = spies[False], spies[True]
    assert len(a["hidden_mbs"]) == 2 and all(n == 16 for _, n in a["hidden_mbs"])  # one micro-batch a step
    long_mbs = [(shape, n) for shape, n in b["hidden_mbs"] if shape[1] > 220]
    assert len(b["hidden_mbs"]) > 2 and len(long_mbs) == 2 and all(n == 1 for _, n in long_mbs)  # alone
    mask = PaddedShard(gs).loss_mask
    assert float((a["values"][1] * mask).abs().sum()) > 0  # the trained head's values
    for va, vb in zip(a["values"], b["values"], strict=True):
        torch.testing.assert_close(vb * mask, va * mask, atol=1e-5, rtol=0)
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and a["loss"][0] > 0
    for ga, gb in zip(a["grads"], b["grads"], strict=True):
        assert sum(float(g.abs().sum()) for g in ga) > 0
        for x, y in zip(ga, gb, strict=True):
            torch.testing.assert_close(y, x, atol=1e-6, rtol=1e-4)
    assert [m.value_loss for m in metrics[True]] == pytest.approx([m.value_loss for m in metrics[False]], rel=1e-5)


def one_group(completions: list[int]):
    g = groups(0, n_groups=1, group_size=len(completions))[0]
    g.prompt_tokens = np.zeros(0, np.int32)
    g.completions = [np.zeros(n, np.int32) for n in completions]
    return g


def test_ranks_dealt_by_the_executed_cost():
    # dense rows of 64 (SDPA on CPU): a long sample's row is its own (causal), a short one shares a masked row
    dense = CostModel(attention_weight=3e-3, path="dense", row_tokens=64)
    long1, short1, long2, short2 = one_group([600]), one_group([40] * 15), one_group([560]), one_group([40] * 14)
    batch = [long1, short1, long2, short2]
    assert group_cost(long1, dense) == pytest.approx(600 + 3e-3 * 600 * 600 / 2)
    assert group_cost(short1, dense) == pytest.approx(600 * (1 + 3e-3 * 64))
    by_tokens, by_cost = balanced_shards(batch, 2), balanced_shards(batch, 2, dense)
    assert by_tokens == [[long1, long2], [short1, short2]]  # 1,160 tokens each
    assert by_cost == [[long1, short2], [short1, long2]]

    def worst(shards):
        return max(sum(group_cost(g, dense) for g in s) for s in shards)

    assert worst(by_cost) < 0.85 * worst(by_tokens)
    samples = shard_samples(batch)
    assert sum(group_cost(g, dense) for g in batch) == pytest.approx(sum(dense.sample(len(s.tokens)) for s in samples))


def test_the_batch_request_carries_the_cost_model():
    req = BatchRequest(schema=SCHEMA_VERSION, run_id="r", step=1, rank=0, world_size=2, attention_weight=3e-3,
                       attention_path="dense", row_tokens=64)
    assert decode_request(encode_request(req), "r") == req
    old = BatchRequest(schema=SCHEMA_VERSION, run_id="r", step=1, rank=0, world_size=2)
    assert (old.attention_weight, old.attention_path, old.row_tokens) == (0.0, "flash", 0)  # tokens alone


def test_deal_gives_the_largest_first_to_the_least_loaded_bin_with_room():
    # 9 -> bin 0, 7 -> bin 1, 5 -> bin 1 (7 < 9), 4 -> bin 0 (9 < 12), 3 -> bin 1 (12 < 13)
    assert deal([5, 9, 3, 7, 4], 2) == [1, 0, 1, 1, 0]
    # The last 1 would go to the lighter bin 1, but it is full at 2 items a bin.
    assert deal([9, 1, 1, 1], 2) == [0, 1, 1, 1]
    assert deal([9, 1, 1, 1], 2, per_bin=2) == [0, 1, 1, 0]
    assert deal([1, 1, 1, 1, 1, 1], 3, per_bin=2) == [0, 1, 2, 0, 1, 2]  # ties: index order, lowest bin
    assert deal([], 4) == []
