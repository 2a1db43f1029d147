"""Numerical guards: log-ratios are clamped before `exp` in every loss path, and a non-finite loss or
gradient norm skips the optimizer step (weights and AdamW state bitwise unchanged, counted as
`nonfinite_steps`); `train.max_nonfinite_steps` of them in a row stop the run with one line."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from async_rl.errors import RunError
from async_rl.learner.driver import LearnerDriver
from async_rl.learner.rl.losses import kl_estimate, kl_penalty, policy_loss
from tests.unit._learner_fixtures import groups, settings

# ---------------------------------------------------------------- clamped log-ratios


def _tokens(log_ratio: float, advantage: float):
    """Four tokens: one whose log-ratio is `log_ratio`, three ordinary ones."""
    behav = torch.full((1, 4), -2.0)
    logp = (behav + torch.tensor([[log_ratio, 0.1, -0.1, 0.0]])).requires_grad_(True)
    adv = torch.full((1, 4), advantage)
    return logp, behav, adv, torch.ones(1, 4)


def _finite(loss: torch.Tensor, logp: torch.Tensor) -> None:
    loss.backward()
    assert torch.isfinite(loss), loss
    assert torch.isfinite(logp.grad).all(), logp.grad
    assert logp.grad[0, 1:].abs().sum() > 0  # the ordinary tokens still have their gradient


@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_behaviour_objective_is_finite_past_exp_overflow(log_ratio, advantage):
    logp, behav, adv, mask = _tokens(log_ratio, advantage)
    loss, _, st = policy_loss(logp, behav, adv, mask, eps_low=0.2, eps_high=0.2, tis_cap=2.0,
                              ratio_mask_low=0.5, ratio_mask_high=2.0)
    _finite(loss, logp)
    assert math.isfinite(st.kl_behav) and math.isfinite(st.tis_frac) and st.masked_frac == 0.25


@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_decoupled_objective_is_finite_past_exp_overflow(log_ratio, advantage):
    """Both ratios of the decoupled objective: pi/pi_prox and the weight pi_prox/mu."""
    logp, behav, adv, mask = _tokens(0.0, advantage)
    prox = logp.detach() - torch.tensor([[log_ratio, 0.0, 0.0, 0.0]])  # pi/pi_prox = e^log_ratio
    loss, _, st = policy_loss(logp, behav, adv, mask, eps_low=0.2, eps_high=0.2, tis_cap=2.0, prox_logp=prox)
    _finite(loss, logp)
    logp, behav, adv, mask = _tokens(0.0, advantage)
    prox = behav + torch.tensor([[log_ratio, 0.0, 0.0, 0.0]])  # pi_prox/mu = e^log_ratio
    loss, _, st = policy_loss(logp, behav, adv, mask, eps_low=0.2, eps_high=0.2, tis_cap=2.0, prox_logp=prox)
    _finite(loss, logp)
    assert math.isfinite(st.tis_frac)


@pytest.mark.parametrize("estimator", ["k2", "k3"])
@pytest.mark.parametrize("delta", [100.0, -100.0])
def test_kl_loss_terms_are_finite_past_exp_overflow(estimator, delta):
    logp, _, _, mask = _tokens(0.0, 1.0)
    ref = logp.detach() - torch.tensor([[delta, 0.3, -0.3, 0.0]])
    term, value = kl_penalty(logp, ref, mask, estimator)
    _finite(term, logp)
    assert math.isfinite(value) and torch.isfinite(kl_estimate(logp.detach(), ref, estimator)).all()


# ---------------------------------------------------------------- non-finite steps are skipped


def snapshot(rank: LearnerDriver) -> tuple[dict, list]:
    """The weights and every tensor of AdamW's state, copied."""
    params = {n: p.detach().clone() for n, p in rank.backend.model.named_parameters()}
    state = [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for s in rank.backend.optimizer.state.values()
    ]
    return params, state


def assert_unchanged(rank: LearnerDriver, snap: tuple[dict, list]) -> None:
    params, state = snap
    for n, p in rank.backend.model.named_parameters():
        assert torch.equal(p, params[n]), n
    now = list(rank.backend.optimizer.state.values())
    assert len(now) == len(state) > 0
    for s, want in zip(now, state, strict=True):
        assert s.keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(s[k], v) if isinstance(v, torch.Tensor) else s[k] == v, k


def nan_gradient(rank: LearnerDriver) -> None:
    """Every later forward/backward leaves one NaN in the first parameter's gradient."""
    forward_backward = rank.backend.forward_backward

    def poisoned(*args, **kwargs):
        forward_backward(*args, **kwargs)
        next(rank.backend.model.parameters()).grad.view(-1)[0] = float("nan")

    rank.backend.forward_backward = poisoned


def test_nan_gradient_skips_the_step_and_keeps_weights_and_adam_state(model_dir):
    rank = LearnerDriver(settings(model_dir, minibatches=2), 0, 1, "", [])
    rank.setup()
    rank.train_on_shard(0, groups(1))  # real steps: AdamW has state now
    snap = snapshot(rank)
    nan_gradient(rank)
    m = rank.train_on_shard(1, groups(2))
    assert m.nonfinite_steps == 2 and m.updates == 2
    assert [u.nonfinite for u in rank.last_updates] == [True, True]
    assert all(not math.isfinite(u.grad_norm) for u in rank.last_updates)
    assert m.grad_norm == 0.0 and math.isfinite(m.loss)  # means over the steps taken: none
    assert_unchanged(rank, snap)
    assert rank.step_count == 2  # the batch still counts (policy version, LR schedule)


def test_nan_loss_skips_the_step(model_dir):
    """A NaN behaviour log-prob makes the loss NaN: the step is skipped before the optimizer."""
    rank = LearnerDriver(settings(model_dir), 0, 1, "", [])
    rank.setup()
    rank.train_on_shard(0, groups(1))
    snap = snapshot(rank)
    bad = groups(2)
    lp = [x.copy() for x in bad[0].logprobs]
    lp[0][0] = np.nan
    bad[0] = dataclasses.replace(bad[0], logprobs=lp)
    m = rank.train_on_shard(1, bad)
    assert m.nonfinite_steps == 1 and not math.isfinite(rank.last_updates[0].loss)
    assert_unchanged(rank, snap)
    m = rank.train_on_shard(2, groups(3))  # the next good batch steps
    assert m.nonfinite_steps == 0 and m.grad_norm > 0


def test_max_nonfinite_steps_in_a_row_stop_with_one_line(model_dir):
    rank = LearnerDriver(settings(model_dir, max_nonfinite_steps=3), 0, 1, "", [])
    rank.setup()
    forward_backward = rank.backend.forward_backward
    nan_gradient(rank)
    rank.train_on_shard(0, groups(1))
    rank.train_on_shard(1, groups(2))
    rank.backend.forward_backward = forward_backward  # a good step in between resets the count
    assert rank.train_on_shard(2, groups(3)).nonfinite_steps == 0
    nan_gradient(rank)
    rank.train_on_shard(3, groups(4))
    rank.train_on_shard(4, groups(5))
    with pytest.raises(RunError) as info:
        rank.train_on_shard(5, groups(6))
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("3 optimizer steps in a row") and "train.max_nonfinite_steps=3" in msg
