"""PPO mini-batches and epochs (`train.minibatches`, `train.epochs`): each batch takes
minibatches x epochs optimizer steps on whole groups, the advantages and the old and proximal
log-probs computed once before the first; the policy version and the LR schedule still count batches.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from async_rl.config import AlgorithmConfig, load_config
from async_rl.errors import ConfigError
from async_rl.learner.driver import LearnerDriver, minibatch_rows
from tests.unit._learner_fixtures import groups, make_rank


def weights(rank: LearnerDriver) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in rank.backend.model.named_parameters()}


def test_rows_are_cut_by_whole_groups():
    gs = groups(0, n_groups=5, group_size=3)
    assert minibatch_rows(gs, 1) == [slice(0, 15)]
    assert minibatch_rows(gs, 2) == [slice(0, 6), slice(6, 15)]  # 2 and 3 groups
    assert minibatch_rows(gs, 5) == [slice(3 * i, 3 * i + 3) for i in range(5)]
    assert minibatch_rows(gs[:1], 2) == [slice(0, 0), slice(0, 3)]  # fewer groups: an empty one


def test_updates_equal_one_step_per_mini_batch(model_dir):
    """minibatches=2, epochs=2 on [g0, g1] takes the four steps g0, g1, g0, g1 that four one-group
    batches take (GRPO's advantages are per group and the behaviour objective's ratio is against
    vLLM's log-probs, so only the split, the per-mini-batch token mean and the step count matter);
    the batch is still one step of the policy version and the LR schedule."""
    g0, g1 = groups(11, n_groups=2)
    mini = make_rank(model_dir, minibatches=2, epochs=2)
    m = mini.train_on_shard(0, [g0, g1])
    assert m.updates == 4 and len(mini.last_updates) == 4 and m.nonfinite_steps == 0
    assert mini.step_count == 1  # one batch: version 1, one LR-schedule step
    assert m.grad_norm == pytest.approx(sum(u.grad_norm for u in mini.last_updates) / 4)
    assert m.loss == pytest.approx(sum(u.loss for u in mini.last_updates) / 4)

    one = make_rank(model_dir)
    for k, g in enumerate([g0, g1, g0, g1]):
        norm = one.train_on_shard(k, [g]).grad_norm
        assert norm == pytest.approx(mini.last_updates[k].grad_norm, rel=1e-5)
    want = weights(one)
    for n, p in weights(mini).items():
        torch.testing.assert_close(p, want[n], rtol=1e-5, atol=1e-6, msg=n)


def test_decoupled_clip_binds_from_the_second_update(model_dir):
    """objective: decoupled with two mini-batches: pi_prox is the weights before the batch's first
    update, so the first update's ratio pi/pi_prox is 1 (no clipping) and the second one's, after the
    weights moved, leaves [1 - eps, 1 + eps] (the clip binds). Mini-batch 2 holds the same tokens and
    rewards as mini-batch 1, so the first update raised exactly the tokens the second one clips."""
    (g,) = groups(5, n_groups=1)
    g = dataclasses.replace(g, rewards=[1.0, 0.0, 0.0])
    rank = make_rank(model_dir, lr=5e-2, minibatches=2, algorithm=AlgorithmConfig(objective="decoupled"))
    rank.train_on_shard(0, [g, g])
    first, second = rank.last_updates
    assert first.clip_frac == 0.0
    assert second.clip_frac > 0.0, second
    assert first.grad_norm > 0 and second.grad_norm > 0


def test_ppo_trains_with_mini_batches_and_epochs(model_dir):
    """ppo's critic still steps once per batch (in prepare); the policy takes minibatches x epochs."""
    rank = make_rank(model_dir, minibatches=2, epochs=2, algorithm=AlgorithmConfig(name="ppo"))
    before = {n: t.clone() for n, t in rank.algo.critic.head.state_dict().items()}
    m = rank.train_on_shard(0, groups(3, n_groups=2))
    assert m.updates == 4 and m.nonfinite_steps == 0 and m.value_loss > 0
    assert all(u.grad_norm > 0 for u in rank.last_updates)
    after = rank.algo.critic.head.state_dict()
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_more_mini_batches_than_groups_per_rank_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.prompts_per_step=4", "learner.world_size=2", "train.minibatches=3"])
    msg = str(info.value)
    assert "\n" not in msg and "train.minibatches=3" in msg and "2 prompt group(s)" in msg
    cfg = load_config(None, ["train.prompts_per_step=4", "learner.world_size=2", "train.minibatches=2"])
    assert (cfg.train.minibatches, cfg.train.epochs) == (2, 1)
