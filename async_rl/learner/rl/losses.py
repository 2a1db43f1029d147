"""Policy loss with off-policy corrections, KL penalty and value loss. Pure tensor functions.

Notation per token: pi = the policy being trained, mu = vLLM's behaviour policy (the log-probs that
came with the sample), pi_prox = the proximal policy (the learner's weights before this update,
recomputed by the learner; decoupled objective only), A = advantage.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import torch

# Every exp of a log difference goes through `exp_log_ratio`: |log ratio| is clamped to this first
# (verl's bound). exp(x) overflows float32 past 88.7, and an inf ratio times a zero gradient from a
# clip or a mask is NaN in the backward pass: one token would poison the whole step. Past the bound
# the token's ratio is constant (no gradient), where the clips have already cut it off anyway.
LOG_RATIO_BOUND = 20.0


def exp_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(log_ratio) with log_ratio clamped to +-LOG_RATIO_BOUND: finite, and a finite gradient."""
    return torch.exp(torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))


class PolicyLossStats(msgspec.Struct):
    loss: float
    clip_frac: float  # fraction of kept tokens where the clipped term was active
    tis_frac: float  # fraction of kept tokens whose importance ratio hit the truncation cap
    masked_frac: float  # fraction of completion tokens masked out for an extreme importance ratio
    kl_behav: float  # k3 estimate of KL(mu || pi) on the sampled tokens (all completion tokens)
    logprob_abs_diff: float  # mean |log pi - log mu| before the update (all completion tokens)
    cov_frac: float = 0.0  # fraction of kept tokens selected by the covariance control (clip_cov / kl_cov)


def extreme_ratio_mask(log_ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """True where exp(log_ratio) is outside [low, high]; a bound of 0 is off."""
    ratio = exp_log_ratio(log_ratio)
    out = torch.zeros_like(ratio, dtype=torch.bool)
    if low > 0:
        out |= ratio < low
    if high > 0:
        out |= ratio > high
    return out


# The order of `policy_loss_terms`' statistics vector (PolicyLossStats' fields).
POLICY_STATS = ("loss", "clip_frac", "tis_frac", "masked_frac", "kl_behav", "logprob_abs_diff", "cov_frac")


def policy_loss(
    logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    tis_cap: float,
    prox_logp: torch.Tensor | None = None,
    ratio_mask_low: float = 0.0,
    ratio_mask_high: float = 0.0,
    denominator: float | None = None,
    clip_cov: torch.Tensor | None = None,
    kl_cov: torch.Tensor | None = None,
    kl_cov_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, PolicyLossStats]:
    """`policy_loss_terms` with its statistics read to the host (one read: a sync on a GPU)."""
    loss, kept, stats = policy_loss_terms(
        logp, behav_logp, advantages, mask, eps_low=eps_low, eps_high=eps_high, tis_cap=tis_cap,
        prox_logp=prox_logp, ratio_mask_low=ratio_mask_low, ratio_mask_high=ratio_mask_high,
        denominator=denominator, clip_cov=clip_cov, kl_cov=kl_cov, kl_cov_coef=kl_cov_coef,
    )
    return loss, kept, PolicyLossStats(**dict(zip(POLICY_STATS, stats.tolist(), strict=True)))


def policy_loss_terms(
    logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    tis_cap: float,
    prox_logp: torch.Tensor | None = None,
    ratio_mask_low: float = 0.0,
    ratio_mask_high: float = 0.0,
    denominator: float | None = None,
    clip_cov: torch.Tensor | None = None,
    kl_cov: torch.Tensor | None = None,
    kl_cov_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The off-policy policy-gradient loss. Returns (loss, kept-token mask, statistics: float [7] on the
    loss's device in the order of POLICY_STATS, left there so that a step reads them once).

    behaviour objective (prox_logp None), with r = pi / mu:
        loss_t = -min(min(r, C) * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
      Truncating r at C bounds negative-advantage tokens whose ratio exploded (for A > 0 the clip
      already bounds it), so stale or mismatched samples cannot dominate.
    decoupled objective (AReaL), with r = pi / pi_prox and w = min(pi_prox / mu, C), w a constant:
        loss_t = -w * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
      The trust region is around the learner's own recent policy, not around whatever (possibly
      several versions old) policy vLLM sampled with; w corrects for the sampling.
    Tokens whose importance ratio against mu (pi_prox / mu, or pi / mu without pi_prox) lies outside
    [ratio_mask_low, ratio_mask_high] are dropped from the loss and counted.
    Every ratio is `exp_log_ratio` of its log ratio (clamped to +-LOG_RATIO_BOUND: no inf, no NaN).
    Covariance controls (Cui et al. 2025; selections from `covariance_selection`, [B, T] 0/1):
    `clip_cov` tokens keep their loss value but contribute no gradient (Clip-Cov); `kl_cov` tokens add
    kl_cov_coef * |log pi - log pi_old| with pi_old = pi_prox, or mu without it (KL-Cov).
    Aggregation: sum over kept tokens / `denominator` (default: the number of kept tokens, i.e. the
    token mean; Dr.GRPO passes a constant). `advantages` is [B, T] or [B, 1] (per sequence).
    """
    mask = mask.to(logp.dtype)
    behav_logp = behav_logp.to(logp.dtype)
    anchor = (prox_logp.to(logp.dtype) if prox_logp is not None else logp).detach()
    is_log_ratio = anchor - behav_logp
    extreme = extreme_ratio_mask(is_log_ratio, ratio_mask_low, ratio_mask_high).to(logp.dtype) * mask
    kept = mask - extreme
    denom = torch.as_tensor(denominator if denominator is not None else kept.sum(), dtype=logp.dtype).clamp(
        min=1.0
    )
    old_logp = anchor if prox_logp is not None else behav_logp
    trained = logp
    if clip_cov is not None:
        # Clip-Cov: the selected tokens' log-probs are constants, so their terms have no gradient.
        trained = torch.where(clip_cov.to(torch.bool), logp.detach(), logp)
    if prox_logp is None:
        ratio = exp_log_ratio(trained - behav_logp)
        unclipped = torch.clamp(ratio, max=tis_cap) * advantages
        weight = torch.ones_like(ratio)
    else:
        ratio = exp_log_ratio(trained - anchor)
        unclipped = ratio * advantages
        weight = torch.clamp(exp_log_ratio(is_log_ratio), max=tis_cap)
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    surrogate = weight * torch.minimum(unclipped, clipped)
    loss = -(surrogate * kept).sum() / denom
    if kl_cov is not None:
        loss = loss + kl_cov_coef * ((logp - old_logp).abs() * kl_cov.to(logp.dtype) * kept).sum() / denom
    selected = clip_cov if clip_cov is not None else kl_cov
    with torch.no_grad():
        n_kept = kept.sum().clamp(min=1.0)
        n_all = mask.sum().clamp(min=1.0)
        lr = (logp - behav_logp).detach()
        zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
        stats = torch.stack([
            loss.detach(),
            ((clipped < unclipped).to(logp.dtype) * kept).sum() / n_kept,
            ((exp_log_ratio(is_log_ratio) > tis_cap).to(logp.dtype) * kept).sum() / n_kept,
            extreme.sum() / n_all,
            ((exp_log_ratio(lr) - 1 - lr) * mask).sum() / n_all,
            (lr.abs() * mask).sum() / n_all,
            zero if selected is None else (selected.to(logp.dtype) * kept).sum() / n_kept,
        ])
    return loss, kept, stats


def token_covariance(
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    reduce: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
) -> torch.Tensor:
    """Per-token (A - mean A) * (log pi_old - mean log pi_old) [B, T], the means over the batch's loss
    tokens (`reduce` sums over data-parallel ranks); 0 off the mask. Its mean is the covariance whose
    sign drives the entropy change of a policy-gradient step (Cui et al. 2025: dH ~ -Cov(log pi, A)):
    high-probability tokens reinforced and low-probability tokens suppressed lower the entropy."""
    mask = mask.to(torch.float64)
    adv = advantages.expand_as(old_logp).to(torch.float64)
    lp = old_logp.detach().to(torch.float64)
    n, sum_a, sum_lp = reduce(torch.stack([mask.sum(), (adv * mask).sum(), (lp * mask).sum()])).tolist()
    n = max(n, 1.0)
    return ((adv - sum_a / n) * (lp - sum_lp / n) * mask).to(torch.float32)


def covariance_selection(
    cov: torch.Tensor,
    mask: torch.Tensor,
    control: str,
    ratio: float,
    low: float = 1.0,
    high: float = 5.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The tokens a covariance control acts on, 0/1 float [B, T], from `token_covariance` over the
    loss tokens `mask`; max(1, int(ratio * loss tokens)) of them at most.
    clip_cov: a uniformly random subset of the tokens whose covariance lies in (low, high) (Clip-Cov:
      the extreme outliers above `high` are left alone, as in the paper);
    kl_cov: the tokens with the highest covariance (KL-Cov)."""
    flat_mask = mask.reshape(-1) > 0
    flat_cov = cov.reshape(-1)
    count = max(1, int(ratio * int(flat_mask.sum())))
    out = torch.zeros(flat_cov.shape, dtype=torch.float32, device=cov.device)
    if control == "clip_cov":
        eligible = (flat_mask & (flat_cov > low) & (flat_cov < high)).nonzero().squeeze(-1)
        order = torch.randperm(eligible.numel(), generator=generator).to(eligible.device)
        out[eligible[order[:count]]] = 1.0
    elif control == "kl_cov":
        candidates = flat_mask.nonzero().squeeze(-1)
        top = torch.topk(flat_cov[candidates], min(count, candidates.numel())).indices
        out[candidates[top]] = 1.0
    else:
        raise ValueError(f"unknown covariance control '{control}' (clip_cov, kl_cov)")
    return out.reshape(cov.shape)


KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimator from tokens sampled by pi, with delta = log pi - log ref.

    As values (sampled under pi), k1 and k3 are unbiased estimates of KL(pi || ref); k2 is biased.
    As loss terms (samples from pi, no gradient through the sampling), each expected gradient is
    E_pi[f'(delta) grad log pi], which is the gradient of a different divergence:
      k1 = delta: f' = 1, expected gradient 0 (noise, no pull to the reference). Use it only in the
        reward (`kl_in_reward`); the config refuses it as a loss term.
      k2 = delta^2 / 2: f' = delta, expected gradient = grad KL(pi || ref).
      k3 = exp(-delta) + delta - 1 (never negative, low variance; GRPO's choice): f' = 1 - ref/pi,
        expected gradient = grad KL(ref || pi), the reverse direction of what its value estimates.
    """
    d = logp - ref_logp.to(logp.dtype)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return exp_log_ratio(-d) + d - 1.0
    raise ValueError(f"unknown KL estimator '{estimator}' {KL_ESTIMATORS}")


def kl_penalty(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    estimator: str,
    denominator: float | None = None,
) -> tuple[torch.Tensor, float]:
    """The KL loss term (before its coefficient): sum over mask / denominator (default: token mean).
    Returns (term, its value as a float: a host read)."""
    term = kl_penalty_term(logp, ref_logp, mask, estimator, denominator)
    return term, float(term.detach())


def kl_penalty_term(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    estimator: str,
    denominator: float | None = None,
) -> torch.Tensor:
    """`kl_penalty`'s term alone (no host read)."""
    mask = mask.to(logp.dtype)
    denom = torch.as_tensor(denominator if denominator is not None else mask.sum(), dtype=logp.dtype).clamp(
        min=1.0
    )
    return (kl_estimate(logp, ref_logp, estimator) * mask).sum() / denom


def value_loss_sum(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """0.5 * sum over masked tokens of (V - R)^2: the critic divides it by the global batch's loss tokens."""
    mask = mask.to(values.dtype)
    return 0.5 * (((values - returns.to(values.dtype)) ** 2) * mask).sum()
