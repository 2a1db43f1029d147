"""Dr.GRPO, RLOO, REINFORCE++ returns, GAE, whitening, the decoupled objective, ratio masking, the KL
penalty and the value loss against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from async_rl.learner.rl.advantages import (
    discounted_returns,
    dr_grpo_advantages,
    gae,
    masked_whiten,
    rloo_advantages,
    token_rewards,
)
from async_rl.learner.rl.losses import (
    extreme_ratio_mask,
    kl_estimate,
    kl_penalty,
    policy_loss,
    value_loss_sum,
)

KW = dict(eps_low=0.2, eps_high=0.2, tis_cap=2.0)


def t(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


def close(got: torch.Tensor, want, atol: float = 1e-9) -> None:
    torch.testing.assert_close(got.to(torch.float64), t(want), rtol=0, atol=atol)


# ---------------------------------------------------------------- sequence-level estimators


def test_dr_grpo_is_mean_baseline_without_std():
    adv = dr_grpo_advantages(t([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 8.0]]))
    assert adv.tolist() == [[0.5, -0.5, -0.5, 0.5], [-3.0, -1.0, 1.0, 3.0]]


def test_dr_grpo_uniform_inexact_float32_group_is_exactly_zero():
    for value in (0.9, 0.7, 0.1):
        adv = dr_grpo_advantages(torch.full((1, 8), value, dtype=torch.float32))
        assert adv.tolist() == [[0.0] * 8]
        assert adv.dtype == torch.float32


def test_rloo_leave_one_out_baseline():
    adv = rloo_advantages(t([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 8.0]]))
    # row 1: 1 - (0 + 0 + 1) / 3 = 2/3, 0 - (1 + 0 + 1) / 3 = -2/3
    # row 2: 2 - 18/3 = -4, 4 - 16/3 = -4/3, 6 - 14/3 = 4/3, 8 - 12/3 = 4
    assert adv[0].tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3], abs=1e-12)
    assert adv[1].tolist() == pytest.approx([-4.0, -4 / 3, 4 / 3, 4.0], abs=1e-12)


def test_rloo_group_of_one_and_uniform_group_are_zero():
    assert rloo_advantages(t([[3.0], [1.0]])).tolist() == [[0.0], [0.0]]
    assert rloo_advantages(torch.full((1, 4), 0.3, dtype=torch.float32)).tolist() == [[0.0] * 4]


# ---------------------------------------------------------------- token-level rewards and returns


def test_token_rewards_land_on_last_completion_token():
    mask = t([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    out = token_rewards(t([2.0, 3.0, 5.0]), mask)
    assert out.tolist() == [[0, 0, 2, 0], [0, 0, 0, 3], [0, 0, 0, 0]]


def test_token_rewards_subtract_kl_on_completion_tokens():
    mask = t([[0, 1, 1, 0]])
    kl = t([[9.0, 0.5, 1.0, 9.0]])
    out = token_rewards(t([2.0]), mask, kl, kl_coef=0.1)
    close(out, [[0.0, -0.05, 2.0 - 0.1, 0.0]], atol=1e-6)  # float32


def test_discounted_returns():
    # rewards (0, 1, 2) on tokens 1..3, gamma 0.5: G3 = 2, G2 = 1 + 1 = 2, G1 = 0 + 1 = 1
    rewards = t([[0.0, 0.0, 1.0, 2.0, 0.0]])
    mask = t([[0, 1, 1, 1, 0]])
    assert discounted_returns(rewards, mask, 0.5).tolist() == [[0.0, 1.0, 2.0, 2.0, 0.0]]


def test_gae_hand_values():
    rewards = t([[0.0, 0.0, 1.0]])
    values = t([[0.5, 0.25, 0.5]])
    mask = t([[1, 1, 1]])
    # gamma 1, lambda 0.5:
    #   t2: delta = 1 - 0.5 = 0.5,           A2 = 0.5
    #   t1: delta = 0 + 0.5 - 0.25 = 0.25,   A1 = 0.25 + 0.5 * 0.5 = 0.5
    #   t0: delta = 0 + 0.25 - 0.5 = -0.25,  A0 = -0.25 + 0.5 * 0.5 = 0
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    close(adv, [[0.0, 0.5, 0.5]])
    close(ret, [[0.5, 0.75, 1.0]])
    # lambda 1 gives Monte-Carlo returns: R = 1 everywhere, A = R - V
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    close(ret, [[1.0, 1.0, 1.0]])
    close(adv, [[0.5, 0.75, 0.5]])


def test_gae_ignores_values_outside_the_completion():
    # prompt position 0 and padding position 3 carry junk values: they must not leak in
    rewards = t([[0.0, 0.0, 2.0, 0.0]])
    values = t([[7.0, 1.0, 0.5, 7.0]])
    mask = t([[0, 1, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=1.0)
    # t2: delta = 2 - 0.5 = 1.5; t1: delta = 0 + 0.5 * 0.5 - 1 = -0.75, A1 = -0.75 + 0.5 * 1.5 = 0
    close(adv, [[0.0, 0.0, 1.5, 0.0]])
    close(ret, [[0.0, 1.0, 2.0, 0.0]])


def test_masked_whiten_hand_values():
    x = t([[1.0, 2.0, 3.0, 100.0]])
    mask = t([[1, 1, 1, 0]])
    # mean 2, population std sqrt(2/3)
    s = math.sqrt(2 / 3)
    close(masked_whiten(x, mask), [[-1 / s, 0.0, 1 / s, 0.0]], atol=1e-7)  # eps in the std


def test_masked_whiten_uses_global_statistics():
    a, b = t([[1.0, 2.0]]), t([[3.0, 6.0]])
    ma, mb = t([[1, 1]]), t([[1, 1]])

    def moments(x, m):
        return torch.stack([m.sum(), (x * m).sum(), (x * x * m).sum()])

    # Two ranks: each one's all-reduce adds the other's moments.
    got_a = masked_whiten(a, ma, lambda own: own + moments(b, mb))
    got_b = masked_whiten(b, mb, lambda own: own + moments(a, ma))
    whole = masked_whiten(torch.cat([a, b], dim=1), torch.cat([ma, mb], dim=1))
    torch.testing.assert_close(torch.cat([got_a, got_b], dim=1), whole, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- the decoupled objective


def decoupled(logp_vals, prox_vals, behav_vals, adv_vals, mask_vals, **kw):
    logp = t(logp_vals).requires_grad_(True)
    args = {**KW, **kw}
    loss, kept, stats = policy_loss(
        logp, t(behav_vals), t(adv_vals), t(mask_vals), prox_logp=t(prox_vals), **args
    )
    loss.backward()
    return loss, logp.grad, kept, stats


def test_decoupled_weights_by_truncated_prox_over_behaviour():
    # pi = pi_prox (one update per batch): r = 1. Token 0: pi_prox/mu = 1.5 -> w 1.5;
    # token 1: pi_prox/mu = 3 -> w = cap 2. Loss = -(1.5 * 1 + 2 * (-1)) / 2 = 0.25.
    lp = [[math.log(0.3), math.log(0.3)]]
    behav = [[math.log(0.2), math.log(0.1)]]
    loss, grad, _, stats = decoupled(lp, lp, behav, [[1.0, -1.0]], [[1, 1]])
    assert loss.item() == pytest.approx(0.25)
    # d loss / d logp = -w * A * r / n
    close(grad, [[-0.75, 1.0]])
    assert stats.tis_frac == pytest.approx(0.5)
    assert stats.clip_frac == 0.0


def test_decoupled_clips_against_prox_not_behaviour():
    # pi / pi_prox = 1.5 > 1.2 with A = 2: clipped (no gradient), although pi / mu = 1 (mu = pi).
    loss, grad, _, stats = decoupled([[math.log(0.6)]], [[math.log(0.4)]], [[math.log(0.6)]], [[2.0]], [[1]])
    # w = pi_prox / mu = 2/3; min(1.5 * 2, 1.2 * 2) = 2.4 -> loss = -2/3 * 2.4
    assert loss.item() == pytest.approx(-1.6)
    assert grad.item() == 0.0
    assert stats.clip_frac == 1.0
    # the behaviour objective on the same tokens: pi / mu = 1, inside the range, gradient -A
    logp = t([[math.log(0.6)]]).requires_grad_(True)
    loss_b, _, stats_b = policy_loss(logp, t([[math.log(0.6)]]), t([[2.0]]), t([[1]]), **KW)
    loss_b.backward()
    assert loss_b.item() == pytest.approx(-2.0) and logp.grad.item() == pytest.approx(-2.0)
    assert stats_b.clip_frac == 0.0


# ---------------------------------------------------------------- masking extreme ratios


def test_extreme_ratio_mask_bounds_and_off():
    lr = torch.log(t([[0.05, 0.5, 1.0, 4.0, 9.0]]))
    assert extreme_ratio_mask(lr, 0.1, 5.0).tolist() == [[True, False, False, False, True]]
    assert extreme_ratio_mask(lr, 0.0, 5.0).tolist() == [[False, False, False, False, True]]
    assert extreme_ratio_mask(lr, 0.0, 0.0).tolist() == [[False] * 5]


def test_extreme_ratio_tokens_are_dropped_and_counted():
    # ratios pi/mu: 9 (masked), 1, 0.05 (masked), and a padding token that is not counted at all
    behav = [[math.log(0.1), math.log(0.5), math.log(0.8), math.log(0.1)]]
    lp = [[math.log(0.9), math.log(0.5), math.log(0.04), math.log(0.9)]]
    logp = t(lp).requires_grad_(True)
    loss, kept, stats = policy_loss(
        logp, t(behav), t([[1.0]]), t([[1, 1, 1, 0]]), ratio_mask_low=0.1, ratio_mask_high=5.0, **KW
    )
    loss.backward()
    assert kept.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert loss.item() == pytest.approx(-1.0)  # only the middle token, A = 1, r = 1
    close(logp.grad, [[0.0, -1.0, 0.0, 0.0]])
    assert stats.masked_frac == pytest.approx(2 / 3)
    # the diagnostics still see every completion token
    assert stats.logprob_abs_diff == pytest.approx((math.log(9) + math.log(20)) / 3)


def test_decoupled_masks_on_prox_over_behaviour():
    # pi_prox / mu = 10 is extreme even though pi = pi_prox
    lp = [[math.log(0.5), math.log(0.5)]]
    loss, _, kept, stats = decoupled(
        lp, lp, [[math.log(0.05), math.log(0.5)]], [[1.0]], [[1, 1]], ratio_mask_high=5.0
    )
    assert kept.tolist() == [[0.0, 1.0]]
    assert stats.masked_frac == 0.5
    assert loss.item() == pytest.approx(-1.0)


# ---------------------------------------------------------------- aggregation


def test_constant_denominator_is_dr_grpo_token_sum():
    # three tokens with A = 1 at r = 1, normalised by a constant 2 sequences * 4 max tokens
    lp = [[-1.0, -1.0, 0.0, 0.0], [-1.0, 0.0, 0.0, 0.0]]
    mask = [[1, 1, 0, 0], [1, 0, 0, 0]]
    loss, _, _ = policy_loss(t(lp), t(lp), t([[1.0], [1.0]]), t(mask), denominator=8.0, **KW)
    assert loss.item() == pytest.approx(-3 / 8)
    token_mean, _, _ = policy_loss(t(lp), t(lp), t([[1.0], [1.0]]), t(mask), **KW)
    assert token_mean.item() == pytest.approx(-1.0)


# ---------------------------------------------------------------- KL to the reference, value loss


def test_kl_estimators_hand_values():
    logp, ref = t([[math.log(0.5)]]), t([[math.log(0.25)]])
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(math.log(2) ** 2 / 2)
    # k3: delta = log 2 -> exp(-delta) + delta - 1 = 0.5 + log 2 - 1
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 + math.log(2) - 1)
    assert kl_estimate(ref, ref, "k3").item() == 0.0
    with pytest.raises(ValueError, match="k9"):
        kl_estimate(logp, ref, "k9")


def test_kl_penalty_is_the_masked_mean_of_the_estimator():
    logp = t([[math.log(0.5), math.log(0.5), -3.0]])
    ref = t([[math.log(0.25), math.log(0.5), 0.0]])
    _, value = kl_penalty(logp, ref, t([[1, 1, 0]]), "k1")
    assert value == pytest.approx(math.log(2) / 2)
    _, value = kl_penalty(logp, ref, t([[1, 1, 0]]), "k3", denominator=4.0)
    assert value == pytest.approx((0.5 + math.log(2) - 1) / 4)


def _expected_loss_gradient(logits: torch.Tensor, ref_logits: torch.Tensor, estimator: str) -> torch.Tensor:
    """d/dlogits of E_{x ~ pi}[estimator(x)] as the loss sees it: the expectation is the sum over the
    support weighted by pi, with no gradient through pi's weights (the sampling)."""
    logits = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(logits, -1)
    term, _ = kl_penalty(logp, torch.log_softmax(ref_logits, -1), logp.exp().detach(), estimator, denominator=1.0)
    (grad,) = torch.autograd.grad(term, logits)
    return grad


def _divergence_gradient(logits: torch.Tensor, ref_logits: torch.Tensor, reverse: bool) -> torch.Tensor:
    """d/dlogits of the exact KL(pi || ref) (reverse: KL(ref || pi)) over the whole support."""
    logits = logits.clone().requires_grad_(True)
    logp, ref = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    kl = (ref.exp() * (ref - logp)).sum() if reverse else (logp.exp() * (logp - ref)).sum()
    (grad,) = torch.autograd.grad(kl, logits)
    return grad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_kl_loss_gradient_is_the_gradient_of_the_divergence_it_claims(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 5, generator=g, dtype=torch.float64)
    ref_logits = torch.randn(1, 5, generator=g, dtype=torch.float64)
    forward, reverse = _divergence_gradient(logits, ref_logits, False), _divergence_gradient(logits, ref_logits, True)
    assert (forward - reverse).abs().max() > 1e-3  # the two directions differ here: the test can tell them apart
    close(_expected_loss_gradient(logits, ref_logits, "k2"), forward.tolist(), atol=1e-12)
    close(_expected_loss_gradient(logits, ref_logits, "k3"), reverse.tolist(), atol=1e-12)
    # k1's expected gradient is zero: it does not pull toward the reference (the config refuses it as a loss)
    close(_expected_loss_gradient(logits, ref_logits, "k1"), [[0.0] * 5], atol=1e-12)


def test_value_loss_hand_values():
    values = t([[1.0, 2.0, 5.0]]).requires_grad_(True)
    loss = value_loss_sum(values, t([[0.0, 0.0, 0.0]]), t([[1, 1, 0]]))
    assert loss.item() == pytest.approx(0.5 * (1 + 4))
    loss.backward()
    close(values.grad, [[1.0, 2.0, 0.0]])
