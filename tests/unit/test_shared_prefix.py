"""One prompt per group (learner/batch/shared_prefix.py, `learner.share_prompt`): the layout holds each
prompt once per block, and a learner step with it equals the unshared step (fp32: log-probs max abs
< 1e-5, gradients relative < 1e-4) for grpo, ppo (values from hidden states) and the decoupled
objective, packed and padded, with multi-turn loss-mask holes, temperature != 1 and a group split
across micro-batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from async_rl.config import AlgorithmConfig
from async_rl.learner.batch.shared_prefix import block_tokens, prompt_runs, shared, split_shared
from async_rl.learner.driver import shard_samples
from async_rl.learner.model.attention import dense_mask
from tests.unit._learner_fixtures import assert_equal_steps, episode_groups, groups, make_rank, spied_step

# ---------------------------------------------------------------- the layout


def test_each_prompt_once_per_block_and_spans_in_sample_order():
    samples = shard_samples(episode_groups(1))
    for pack in (True, False):
        mb = shared(samples, 0, pack)
        assert len(prompt_runs(samples)) == 3
        # positions: one prefix per group (prompt minus its last token) + one suffix per sample
        # (token ids are >= 3 here; padding is 0)
        expected = sum(s.start - 1 for s in samples[::4]) + sum(len(s.tokens) - s.start + 1 for s in samples)
        assert int((mb.input_ids != 0).sum()) == expected
        assert expected < sum(len(s.tokens) for s in samples)
        assert mb.attention_mask is None  # the block mask is built on the device from the segments
        assert dense_mask(mb.segments).shape == (mb.input_ids.shape[0], 1, mb.input_ids.shape[1], mb.input_ids.shape[1])
        # the spans hold each sample's completion tokens as targets, in the samples' order
        for s, (row, col, n) in zip(samples, mb.spans, strict=True):
            assert n == len(s.tokens) - s.start
            assert mb.targets[row, col : col + n].tolist() == s.tokens[s.start :].tolist()
            assert mb.position_ids[row, col].item() == s.start - 1  # the last prompt token keeps its position
    mb = shared(samples, 0, pack=False)
    assert mb.input_ids.shape[0] == 3  # padded: one block (group) per row
    assert mb.input_ids.shape[1] == max(
        (r[0].start - 1) + sum(len(s.tokens) - s.start + 1 for s in r) for r in prompt_runs(samples)
    )


def test_the_mask_lets_a_suffix_see_its_prefix_and_itself_only():
    samples = shard_samples(groups(2, n_groups=2, group_size=2))
    mb = shared(samples, 0, pack=True)
    m = dense_mask(mb.segments)[:, 0]
    for row, col, n in mb.spans:
        # a suffix position sees exactly the prompt (positions 0..start-2 of its prefix) and itself causally
        q = col + n - 1
        seen = m[row, q].nonzero().squeeze(-1).tolist()
        assert len(seen) == int(mb.position_ids[row, q]) + 1
        assert mb.position_ids[row, seen].tolist() == list(range(len(seen)))
    assert bool(m.any(-1).all())  # no empty query row (padding sees itself)


def test_a_group_larger_than_a_micro_batch_is_cut_with_its_prompt_in_each_piece():
    samples = shard_samples(groups(3, n_groups=3, group_size=6))
    prefix = samples[0].start - 1
    budget = prefix + 2 * max(len(s.tokens) - s.start + 1 for s in samples[:6])
    chunks = split_shared(samples, 0, budget)
    assert [s for c in chunks for s in c] == samples  # order kept, nothing lost
    first_group = [c for c in chunks if any(s is x for s in c for x in samples[:6])]
    assert len(first_group) > 1  # the group was cut
    assert all(sum(block_tokens(r) for r in prompt_runs(c)) <= budget or len(c) == 1 for c in chunks)
    # whole groups that fit stay together
    small = split_shared(samples, 0, 10_000)
    assert len(small) == 1
    by_group = split_shared(samples, 12, 0)  # 12 sequences: two whole groups, then the third
    assert [len(c) for c in by_group] == [12, 6]


# ---------------------------------------------------------------- a learner step, shared vs unshared


ALGORITHMS = {
    "grpo": AlgorithmConfig(name="grpo"),
    "ppo": AlgorithmConfig(name="ppo"),  # GAE on a critic reading the hidden states of the scoring pass
    "decoupled": AlgorithmConfig(name="grpo", objective="decoupled"),
    # the entropy controls: the bonus's gradient and the covariance selection ride through the layout
    "kl_cov": AlgorithmConfig(name="grpo", entropy_coef=0.05, cov_control="kl_cov", cov_ratio=0.3),
}


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("algo", list(ALGORITHMS))
def test_shared_step_equals_unshared(model_dir, algo, packing):
    """Multi-turn holes, temperature 0.7, and micro-batches small enough that a group is cut."""
    gs = episode_groups(10)
    common = {"algorithm": ALGORITHMS[algo], "packing": packing, "micro_batch_tokens": 20, "temperature": 0.7}
    off = spied_step(make_rank(model_dir, share_prompt=False, **common), gs)
    on_rank = make_rank(model_dir, share_prompt=True, **common)
    on = spied_step(on_rank, gs)
    assert_equal_steps(off, on)
    if ALGORITHMS[algo].cov_control != "none":  # the selected tokens reached the loss in both layouts
        assert all(mb.cov_select is not None and mb.cov_select.sum() > 0 for mb in on["mbs"][:1])
        assert on["metrics"].cov_frac > 0
    chunks = split_shared(shard_samples(gs), 0, 20)
    runs = [len(prompt_runs(c)) for c in chunks]
    assert len(chunks) > 1 and sum(runs) > len(gs)  # some group was split across micro-batches
    assert all(mb.segments.shares_prefixes for mb in on["mbs"])
    # fewer positions computed with one prompt per group (token ids >= 3; padding is 0)
    assert sum(int((m.input_ids != 0).sum()) for m in on["mbs"]) < sum(int((m.input_ids != 0).sum()) for m in off["mbs"])


def test_shared_step_equals_unshared_kl_and_rows(model_dir):
    """The KL reference in the loss and packed rows narrower than a group (blocks cut by row width)."""
    gs = episode_groups(11, group_size=3)
    common = {"algorithm": AlgorithmConfig(name="grpo", kl_coef=0.05), "pack_row_tokens": 20, "temperature": 1.0}
    off = spied_step(make_rank(model_dir, share_prompt=False, **common), gs)
    on = spied_step(make_rank(model_dir, share_prompt=True, **common), gs)
    assert_equal_steps(off, on)


def test_compute_logprobs_shared_equals_unshared(model_dir):
    gs = episode_groups(12)
    a = make_rank(model_dir, share_prompt=False).compute_logprobs(gs, 0.8)
    b = make_rank(model_dir, share_prompt=True).compute_logprobs(gs, 0.8)
    assert [len(x) for x in b] == [len(c) for g in gs for c in g.completions]
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(y, x, atol=1e-5, rtol=0)


class _MaskFreeBackend:
    """A backend that takes no block mask (as megatron's): the driver must not hand it one."""

    device = torch.device("cpu")
    weights_are_live = False
    takes_block_masks = False
    head_kernel = "eager"
    keeps_logits = False
    moe = None  # a dense model
    replays_routes = False
    attention_path = "dense"

    def setup(self, model_dir: str) -> int:
        return 0

    def base_reference(self, cut, logprob_chunk_tokens: int, head_kernel: str = "eager") -> None:
        return None

    def reference_share(self) -> None:
        return None

    def hf_weights(self) -> dict[str, torch.Tensor]:
        return {}

    def served_weights(self) -> dict[str, torch.Tensor]:
        return {}


def test_a_backend_without_block_masks_falls_back_with_a_note(model_dir, monkeypatch, capsys):
    from async_rl.learner import driver as driver_mod

    monkeypatch.setattr(driver_mod, "make_backend", lambda *a, **k: _MaskFreeBackend())
    rank = make_rank(model_dir, share_prompt=True)
    assert rank.share_prompt is False
    assert "learner.share_prompt" in capsys.readouterr().err


def test_split_agent_episodes_step_the_same_shared_and_count_as_episodes(model_dir):
    """Agent episodes split at prefix breaks (docs/agents.md): each segment a sample with its
    episode's reward. The shared-prompt step equals the unshared one, and the step's metrics count
    episodes (samples, reward mean) while its lengths count every trained sequence."""
    gs = episode_groups(12, n_groups=2, group_size=4)
    for g in gs:
        g.rewards[1] = g.rewards[0]
        g.episode_of = [0, 0, 1, 2]  # 3 episodes, the first in two segments
    common = {"algorithm": AlgorithmConfig(name="grpo"), "micro_batch_tokens": 20}
    off = spied_step(make_rank(model_dir, share_prompt=False, **common), gs)
    on = spied_step(make_rank(model_dir, share_prompt=True, **common), gs)
    assert_equal_steps(off, on)
    m = on["metrics"]
    assert m.samples == 6 and len(m.completion_lens) == 8
    assert m.reward_mean == pytest.approx(np.mean([r for g in gs for r in g.rewards[1:]]))
