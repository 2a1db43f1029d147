"""Advantages, the off-policy PPO loss and token log-probs against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from async_rl.learner.rl.advantages import grpo_advantages
from async_rl.learner.rl.algorithms import token_logprobs
from async_rl.learner.rl.losses import PolicyLossStats, policy_loss

EPS_LOW, EPS_HIGH, TIS_CAP = 0.2, 0.2, 2.0


def t(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


def loss_and_grad(logp_vals, behav_vals, adv_vals, mask_vals, eps_low=EPS_LOW, eps_high=EPS_HIGH, tis_cap=TIS_CAP):
    logp = t(logp_vals).requires_grad_(True)
    loss, _, stats = policy_loss(
        logp, t(behav_vals), t(adv_vals), t(mask_vals), eps_low=eps_low, eps_high=eps_high, tis_cap=tis_cap
    )
    loss.backward()
    return loss, logp.grad, stats


# ---------------------------------------------------------------- GRPO advantages


def test_grpo_hand_computed_group():
    adv = grpo_advantages(t([[1.0, 0.0, 0.0, 1.0]]))
    # mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025
    a = 0.5 / math.sqrt(1 / 3)
    assert a == pytest.approx(0.8660254)
    assert adv.tolist()[0] == pytest.approx([a, -a, -a, a], abs=1e-5)


def test_grpo_groups_are_normalised_independently():
    adv = grpo_advantages(t([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 3.0], [2.0, 4.0, 6.0, 8.0]]))
    # row 2: mean .75, deviations (-.75, -.75, -.75, 2.25), var = 6.75 / 3 = 2.25, std 1.5
    # row 3: mean 5, deviations (-3, -1, 1, 3), var = 20 / 3
    s3 = math.sqrt(20 / 3)
    want = [
        [0.8660254, -0.8660254, -0.8660254, 0.8660254],
        [-0.5, -0.5, -0.5, 1.5],
        [-3 / s3, -1 / s3, 1 / s3, 3 / s3],
    ]
    for got_row, want_row in zip(adv.tolist(), want, strict=True):
        assert got_row == pytest.approx(want_row, abs=1e-5)
    assert adv.sum(dim=1).abs().max() < 1e-9
    assert adv.shape == (3, 4)


def test_grpo_uniform_group_is_zero():
    adv = grpo_advantages(t([[0.5, 0.5, 0.5, 0.5], [1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    assert adv[0].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert adv[2].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert adv[1].abs().min() > 0.8


def test_grpo_uniform_group_of_inexact_float32_rewards_is_zero():
    # Regression (fixed): grpo_advantages: the docstring promises 0 for a
    # group whose rewards are all equal, but for float32 rewards that are not exact binary fractions
    # (0.9 * 8, as PaddedShard builds them) the mean is off by one ulp and the std is
    # ~1e-8, so (r - mean) / (std + 1e-6) gives about -0.056 for every sample instead of 0: a
    # systematic push against every completion of a group that carries no signal.
    for value in (0.9, 0.7, 0.3, 0.1):
        adv = grpo_advantages(torch.full((1, 8), value, dtype=torch.float32))
        assert adv.abs().max().item() < 1e-4, (value, adv.tolist())


def test_grpo_group_of_one_is_zero():
    adv = grpo_advantages(t([[3.0], [-1.0]]))
    assert adv.shape == (2, 1)
    assert adv.tolist() == [[0.0], [0.0]]


def test_grpo_keeps_dtype():
    assert grpo_advantages(torch.tensor([[1.0, 0.0]], dtype=torch.float32)).dtype == torch.float32


# ---------------------------------------------------------------- PPO-clip with truncated IS


def test_ratio_one_loss_is_minus_masked_mean_advantage():
    lp = [[-1.0, -2.0, -0.5], [-0.3, -0.7, -0.9]]
    adv = [[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]]
    mask = [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    loss, grad, stats = loss_and_grad(lp, lp, adv, mask)
    # masked advantages 1 + 1 - 0.5 over 3 tokens
    assert loss.item() == pytest.approx(-0.5)
    assert stats.loss == pytest.approx(-0.5)
    # d loss / d logp = -A * ratio / n on masked tokens, 0 elsewhere
    torch.testing.assert_close(grad, t([[-1 / 3, -1 / 3, 0.0], [0.5 / 3, 0.0, 0.0]]))
    assert stats.clip_frac == 0.0
    assert stats.tis_frac == 0.0
    assert stats.kl_behav == pytest.approx(0.0, abs=1e-12)
    assert stats.logprob_abs_diff == 0.0


def test_positive_advantage_above_clip_is_clipped():
    # token 0: ratio 0.6 / 0.4 = 1.5 > 1.2, A = 2 -> min(1.5 * 2, 1.2 * 2) = 2.4, no gradient
    # token 1: ratio 0.55 / 0.5 = 1.1 inside the clip range, A = 2 -> 2.2, gradient -A * r / n = -1.1
    loss, grad, stats = loss_and_grad(
        [[math.log(0.6), math.log(0.55)]],
        [[math.log(0.4), math.log(0.5)]],
        [[2.0, 2.0]],
        [[1.0, 1.0]],
    )
    assert loss.item() == pytest.approx(-(2.4 + 2.2) / 2)
    assert grad[0, 0].item() == 0.0
    assert grad[0, 1].item() == pytest.approx(-1.1)
    assert stats.clip_frac == pytest.approx(0.5)
    assert stats.tis_frac == 0.0
    # k3: (r - 1) - log r per token, averaged
    k3 = ((1.5 - 1 - math.log(1.5)) + (1.1 - 1 - math.log(1.1))) / 2
    assert stats.kl_behav == pytest.approx(k3, rel=1e-9)
    assert stats.logprob_abs_diff == pytest.approx((math.log(1.5) + math.log(1.1)) / 2, rel=1e-9)


def test_negative_advantage_above_tis_cap_is_truncated():
    # ratio 0.3 / 0.1 = 3 > cap 2, A = -1: min(2 * -1, 1.2 * -1) = -2 -> loss 2, no gradient
    loss, grad, stats = loss_and_grad([[math.log(0.3)]], [[math.log(0.1)]], [[-1.0]], [[1.0]])
    assert loss.item() == pytest.approx(2.0)
    assert grad.item() == 0.0
    assert stats.tis_frac == 1.0
    assert stats.clip_frac == 0.0
    assert stats.kl_behav == pytest.approx(3 - 1 - math.log(3))
    assert stats.logprob_abs_diff == pytest.approx(math.log(3))


def test_negative_advantage_below_tis_cap_is_not_truncated():
    # ratio 1.5 < cap, A = -1: min(-1.5, -1.2) = -1.5 -> loss 1.5, gradient -A * r = 1.5 (unclipped term)
    loss, grad, stats = loss_and_grad([[math.log(0.6)]], [[math.log(0.4)]], [[-1.0]], [[1.0]])
    assert loss.item() == pytest.approx(1.5)
    assert grad.item() == pytest.approx(1.5)
    assert stats.tis_frac == 0.0
    assert stats.clip_frac == 0.0


def test_below_one_minus_eps():
    # ratio 0.5: A = 1 -> min(0.5, 0.8) = 0.5 (unclipped, gradient -0.5 / 2)
    #            A = -1 -> min(-0.5, -0.8) = -0.8 (clipped, no gradient)
    loss, grad, stats = loss_and_grad(
        [[math.log(0.2), math.log(0.2)]], [[math.log(0.4), math.log(0.4)]], [[1.0, -1.0]], [[1.0, 1.0]]
    )
    assert loss.item() == pytest.approx(-(0.5 - 0.8) / 2)
    assert grad[0, 0].item() == pytest.approx(-0.25)
    assert grad[0, 1].item() == 0.0
    assert stats.clip_frac == pytest.approx(0.5)


def test_asymmetric_clip_bounds():
    # eps_low 0.1, eps_high 0.3: ratio 1.25 with A = 1 is inside (1.25 < 1.3), ratio 0.85 with A = -1 is clipped
    loss, grad, stats = loss_and_grad(
        [[math.log(0.5), math.log(0.34)]],
        [[math.log(0.4), math.log(0.4)]],
        [[1.0, -1.0]],
        [[1.0, 1.0]],
        eps_low=0.1,
        eps_high=0.3,
    )
    assert loss.item() == pytest.approx(-(1.25 - 0.9) / 2)
    assert grad[0, 0].item() == pytest.approx(-1.25 / 2)
    assert grad[0, 1].item() == 0.0
    assert stats.clip_frac == pytest.approx(0.5)


def test_mask_excludes_tokens():
    lp = [[math.log(0.5), math.log(0.9), math.log(0.2)]]
    behav = [[math.log(0.5), math.log(0.1), math.log(0.2)]]  # middle token: ratio 9, huge advantage
    adv = [[1.0, 100.0, 1.0]]
    loss, grad, stats = loss_and_grad(lp, behav, adv, [[1.0, 0.0, 1.0]])
    assert loss.item() == pytest.approx(-1.0)
    assert grad[0, 1].item() == 0.0
    assert grad[0, 0].item() == pytest.approx(-0.5)
    assert stats.tis_frac == 0.0 and stats.clip_frac == 0.0
    assert stats.kl_behav == pytest.approx(0.0, abs=1e-12)
    assert stats.logprob_abs_diff == pytest.approx(0.0, abs=1e-12)
    # the same tokens with the mask open
    _, _, open_stats = loss_and_grad(lp, behav, adv, [[1.0, 1.0, 1.0]])
    assert open_stats.tis_frac == pytest.approx(1 / 3)
    assert open_stats.logprob_abs_diff == pytest.approx(math.log(9) / 3)


def test_bool_mask_and_all_masked():
    logp = t([[-1.0, -2.0]]).requires_grad_(True)
    kw = dict(eps_low=0.2, eps_high=0.2, tis_cap=2.0)
    loss, _, stats = policy_loss(logp, t([[-1.0, -2.0]]), t([[1.0]]), torch.tensor([[True, False]]), **kw)
    assert loss.item() == pytest.approx(-1.0)  # advantages broadcast per sequence
    loss, _, stats = policy_loss(logp, t([[-1.0, -2.0]]), t([[1.0]]), torch.tensor([[False, False]]), **kw)
    assert loss.item() == 0.0  # denominator clamped to 1: no division by zero
    assert not math.isnan(stats.kl_behav)


def test_stats_mix_hand_values():
    # four tokens, one masked out:
    #  a: r = 1.5, A = +1 -> clipped (clip active)
    #  b: r = 3,   A = -1 -> truncated (tis)
    #  c: r = 1,   A = +1 -> plain
    #  d: masked
    r = [1.5, 3.0, 1.0, 5.0]
    behav = [math.log(0.1)] * 4
    lp = [math.log(0.1 * x) for x in r]
    loss, grad, stats = loss_and_grad([lp], [behav], [[1.0, -1.0, 1.0, 1.0]], [[1.0, 1.0, 1.0, 0.0]])
    assert isinstance(stats, PolicyLossStats)
    assert loss.item() == pytest.approx(-(1.2 - 2.0 + 1.0) / 3)
    assert stats.clip_frac == pytest.approx(1 / 3)
    assert stats.tis_frac == pytest.approx(1 / 3)
    k3 = [x - 1 - math.log(x) for x in r[:3]]
    assert stats.kl_behav == pytest.approx(sum(k3) / 3, rel=1e-9)
    assert stats.logprob_abs_diff == pytest.approx((math.log(1.5) + math.log(3.0)) / 3, rel=1e-9)
    assert grad.tolist()[0] == pytest.approx([0.0, 0.0, -1 / 3, 0.0])


# ---------------------------------------------------------------- token log-probs


def test_token_logprobs_hand_values():
    # logits (0, 0, ln 2): softmax (1/4, 1/4, 1/2)
    logits = torch.tensor([[[0.0, 0.0, math.log(2.0)], [math.log(2.0), 0.0, 0.0]]])
    targets = torch.tensor([[2, 1]])
    got = token_logprobs(logits, targets)
    assert got.shape == (1, 2)
    assert got[0].tolist() == pytest.approx([math.log(0.5), math.log(0.25)], rel=1e-6)


def test_token_logprobs_respects_temperature():
    logits = torch.tensor([[[0.0, 0.0, math.log(2.0)]]])
    got = token_logprobs(logits, torch.tensor([[2]]), temperature=2.0)
    # logits / 2 -> exp = (1, 1, sqrt 2): p = sqrt 2 / (2 + sqrt 2)
    want = math.log(math.sqrt(2) / (2 + math.sqrt(2)))
    assert got.item() == pytest.approx(want, rel=1e-6)
    assert token_logprobs(logits, torch.tensor([[2]]), temperature=1.0).item() == pytest.approx(math.log(0.5))


def test_token_logprobs_matches_log_softmax_gather():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g)
    targets = torch.randint(0, 11, (3, 5), generator=g)
    for temp in (1.0, 0.7):
        got = token_logprobs(logits, targets, temperature=temp)
        want = torch.empty(3, 5)
        for b in range(3):
            for i in range(5):
                want[b, i] = torch.log_softmax(logits[b, i] / temp, dim=-1)[targets[b, i]]
        torch.testing.assert_close(got, want)


def test_token_logprobs_float32_from_bfloat16_and_differentiable():
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).requires_grad_(True)
    out = token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long))
    assert out.dtype == torch.float32
    assert (out <= 0).all()
    out.sum().backward()
    assert logits.grad is not None and logits.grad.shape == logits.shape
