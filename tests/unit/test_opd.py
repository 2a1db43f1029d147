"""On-policy distillation (algorithm.name=opd): each sampled model token's advantage is
-(log pi_old - log teacher), plus the task rewards' group advantage when mixed in; environment tokens,
unscored samples and padding get none; the policy-gradient loss and its corrections are the RL ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from async_rl.config import AlgorithmConfig, ConfigError, load_config
from async_rl.learner.batch.padded import PaddedShard
from async_rl.learner.driver import shard_samples
from async_rl.learner.rl.advantages import distill_advantages
from async_rl.learner.rl.algorithms import Algorithm
from async_rl.protocol import REWARD_OK, TrajectoryGroup, decode_groups, encode_groups

F = np.float32


def algorithm(**fields) -> Algorithm:
    return Algorithm(
        AlgorithmConfig(name="opd", **fields), max_tokens=8, temperature=1.0, model_dir="", dtype=torch.float32,
        hidden_size=8, seed=0, max_grad_norm=1.0,
    )


def batch() -> list[TrajectoryGroup]:
    """One group of three: a plain sample, a multi-turn one whose second token is the environment's,
    and one the teacher did not score. The frame round trip is the learner's path."""
    g = TrajectoryGroup(
        prompt_id=1,
        engine_id=0,
        prompt_tokens=np.array([5, 6], np.int32),
        completions=[np.array([7, 8, 9], np.int32), np.array([10, 11, 12], np.int32), np.array([13, 14], np.int32)],
        logprobs=[np.array([-0.5, -1.0, -2.0], F), np.array([-0.25, 0.0, -3.0], F), np.array([-1.0, -1.5], F)],
        rewards=[1.0, 0.0, 0.0],
        version_first=[0, 0, 0],
        version_last=[0, 0, 0],
        reward_status=[REWARD_OK] * 3,
        loss_masks=[None, np.array([1, 0, 1], np.uint8), None],
        teacher_logprobs=[np.array([-0.25, -3.0, -1.0], F), np.array([-0.75, 0.0, -0.5], F), None],
    )
    return decode_groups(encode_groups("r", [g]), "r")[1]


# By hand: advantage = -(student - teacher) = teacher - student on scored model tokens.
#   sample 0: (-0.25 + 0.5, -3.0 + 1.0, -1.0 + 2.0) = (0.25, -2.0, 1.0)
#   sample 1: (-0.75 + 0.25, env token: 0, -0.5 + 3.0) = (-0.5, 0, 2.5)
#   sample 2: unscored: (0, 0)
HAND = [[0.25, -2.0, 1.0], [-0.5, 0.0, 2.5], [0.0, 0.0]]


def per_sample(groups, prepared) -> list[list[float]]:
    return [s.advantages.tolist() for s in shard_samples(groups, prepared)]


def test_opd_advantage_equals_hand_computation():
    groups = batch()
    p = algorithm().prepare(PaddedShard(groups), lambda _: (None, None))
    assert per_sample(groups, p) == HAND
    # reverse KL, log pi_old - log teacher, over the 5 scored model tokens: -(0.25 - 2 + 1 - 0.5 + 2.5) / 5
    assert p.teacher_tokens == 5
    assert p.kl_teacher == pytest.approx(-1.25 / 5)


def test_distill_coef_scales_and_task_rewards_mix_in():
    groups = batch()
    p = algorithm(distill_coef=0.5, distill_rewards="rloo").prepare(PaddedShard(groups), lambda _: (None, None))
    # RLOO over rewards (1, 0, 0): 1 - 0 = 1, 0 - 0.5 = -0.5, -0.5; on every model token (not the env token)
    rloo = [1.0, -0.5, -0.5]
    want = [
        [0.5 * a + rloo[i] * m for a, m in zip(row, mask, strict=True)]
        for i, (row, mask) in enumerate(zip(HAND, [[1, 1, 1], [1, 0, 1], [1, 1]], strict=True))
    ]
    assert sum(per_sample(groups, p), []) == pytest.approx(sum(want, []))


def test_decoupled_objective_takes_the_proximal_logprobs_as_the_student():
    groups = batch()
    shard = PaddedShard(groups)
    prox = torch.full(shard.loss_mask.shape, -1.0)
    p = algorithm(objective="decoupled").prepare(shard, lambda _: (prox, None))
    # teacher - (-1) on scored model tokens
    assert per_sample(groups, p) == [[0.75, -2.0, 0.0], [0.25, 0.0, 0.5], [0.0, 0.0]]


def test_opd_loss_gradient_is_the_policy_gradient_of_the_advantage():
    """With pi = mu (on-policy, first update) the loss's gradient w.r.t. log pi is -A / tokens: the
    policy-gradient loss with our corrections, unchanged."""
    groups = batch()
    shard = PaddedShard(groups)
    algo = algorithm()
    p = algo.prepare(shard, lambda _: (None, None))
    logp = shard.behav_logp.clone().requires_grad_()
    loss, stats = algo.loss(p, logp)
    loss.backward()
    assert torch.allclose(logp.grad, -p.advantages * p.mask / p.denominator)
    assert stats.clip_frac == 0.0


def test_distill_advantages_zero_off_scored_tokens():
    s = torch.tensor([[-1.0, -2.0]])
    t = torch.tensor([[-0.5, -9.0]])
    assert distill_advantages(s, t, torch.tensor([[1.0, 0.0]]), 2.0).tolist() == [[1.0, 0.0]]


def test_opd_config_errors_are_one_line():
    with pytest.raises(ConfigError, match="needs teacher.model"):
        load_config(None, ["algorithm.name=opd"])
    with pytest.raises(ConfigError, match="no learning signal"):
        load_config(None, ["algorithm.name=opd", "algorithm.distill_coef=0", "teacher.model=tiny-qwen2"])
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        load_config(None, ["algorithm.name=opd", "algorithm.dynamic_sampling=true", "teacher.model=tiny-qwen2"])
