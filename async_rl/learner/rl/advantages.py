"""Advantage estimators. Pure tensor functions, unit-tested on hand-computed values.

Sequence-level estimators (GRPO, Dr.GRPO, RLOO) take rewards as [groups, n] (one row per prompt
group) and return one advantage per sample. Token-level estimators (REINFORCE++, GAE) work on
[batch, tokens] tensors aligned with the loss mask: the 1s of a row are its model's tokens, in
order; a multi-turn episode's environment tokens are holes (0s) between them. The sequence reward
lands on the last model token, and returns/GAE run over the model's tokens only, skipping the holes
(an environment turn is not a step of the policy: no discount, no value there).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Sums a small tensor over the data-parallel ranks (identity on one rank): "global batch" statistics.
AllReduce = Callable[[torch.Tensor], torch.Tensor]


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: normalise each group's rewards by its mean and (unbiased) std. rewards: [groups, n].

    A group whose rewards are all equal has no signal: its advantages are 0. So is a group of one.
    """
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    # float64: in float32 a group of equal but inexact rewards (0.9, 0.9, ...) gets a mean one
    # rounding step off and a tiny std, i.e. spurious non-zero advantages.
    r = rewards.to(torch.float64)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True)
    adv = (r - mean) / (std + eps)
    adv = torch.where(std > 1e-9 * (1.0 + mean.abs()), adv, torch.zeros_like(adv))
    return adv.to(rewards.dtype)


def dr_grpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO: the group mean as baseline, no division by the std (which over-weights groups that are
    almost all right or all wrong). rewards: [groups, n]."""
    r = rewards.to(torch.float64)
    adv = r - r.mean(dim=1, keepdim=True)
    # A uniform group of inexact floats must give exactly 0, not +-1 ulp (see grpo_advantages).
    adv = torch.where(adv.abs() > 1e-12 * (1.0 + r.abs()), adv, torch.zeros_like(adv))
    return adv.to(rewards.dtype)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO: each sample's baseline is the mean of the *other* n-1 rewards of its group.

    r_i - (sum - r_i) / (n - 1) = n / (n - 1) * (r_i - mean). A group of one has no baseline: 0.
    """
    n = rewards.shape[1]
    if n < 2:
        return torch.zeros_like(rewards)
    return (dr_grpo_advantages(rewards).to(torch.float64) * (n / (n - 1))).to(rewards.dtype)


def overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer_tokens: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the reward: 0 up to max_tokens - buffer_tokens, then
    falling linearly to -penalty at max_tokens (and below it past max_tokens). lengths: completion
    tokens, any shape -> the same shape, float32."""
    start = max_tokens - buffer_tokens
    over = (lengths.to(torch.float32) - start).clamp(min=0.0)
    return -penalty * torch.clamp(over / buffer_tokens, max=1.0)


def token_rewards(
    seq_rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """Per-token rewards: the sequence reward on the last completion token, minus kl_coef * kl on every
    completion token. seq_rewards [B], mask/kl [B, T] -> [B, T] (0 outside the mask)."""
    mask = mask.to(torch.float32)
    out = torch.zeros_like(mask)
    lengths = mask.sum(dim=1)
    has_tokens = lengths > 0
    # Index of the last 1 in each row (holes or not): the argmax of a ramp that is 0 outside the mask.
    ramp = torch.arange(mask.shape[1], dtype=torch.float32).expand_as(mask) * mask
    last = ramp.argmax(dim=1)
    rows = torch.arange(mask.shape[0])[has_tokens]
    out[rows, last[has_tokens]] = seq_rewards.to(torch.float32)[has_tokens]
    if kl is not None and kl_coef:
        out = out - kl_coef * kl.to(torch.float32) * mask
    return out


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} over each row's completion tokens (0 outside). [B, T] -> [B, T]."""
    return gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)[0]


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each row's completion tokens. [B, T] each.

    delta_t = r_t + gamma * V_{t+1} - V_t (V after the last token = 0), A_t = delta_t + gamma * lam * A_{t+1},
    where t+1 is the row's next *masked* token: holes (environment tokens) are skipped, not ended at.
    Returns (advantages, returns = advantages + values), both 0 outside the mask.
    """
    mask = mask.to(torch.float32)
    rewards = rewards.to(torch.float32)
    values = values.to(torch.float32) * mask
    adv = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0])  # A of the next masked token (0 past the last one)
    next_value = torch.zeros(rewards.shape[0])  # V of the next masked token
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        here = delta + gamma * lam * running
        # Outside the mask the running values pass through unchanged (a hole, or prompt/padding).
        running = m * here + (1 - m) * running
        next_value = m * values[:, t] + (1 - m) * next_value
        adv[:, t] = here * m
    return adv, (adv + values) * mask


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, all_reduce: AllReduce = _no_reduce, eps: float = 1e-8
) -> torch.Tensor:
    """(x - mean) / std over the masked entries of the whole (global) batch; 0 outside the mask.

    `all_reduce` sums [count, sum, sum of squares] over data-parallel ranks, so every rank normalises
    with the same statistics (REINFORCE++'s global batch normalisation). std is the population std.
    """
    mask = mask.to(torch.float64)
    xd = x.to(torch.float64) * mask
    moments = all_reduce(torch.stack([mask.sum(), xd.sum(), (xd * xd).sum()]))
    count = moments[0].clamp(min=1.0)
    mean = moments[1] / count
    var = (moments[2] / count - mean * mean).clamp(min=0.0)
    return (((xd - mean) / (var.sqrt() + eps)) * mask).to(x.dtype)


def distill_advantages(
    student_logp: torch.Tensor, teacher_logp: torch.Tensor, scored: torch.Tensor, coef: float = 1.0
) -> torch.Tensor:
    """On-policy distillation (Agarwal et al. 2024; Thinking Machines 2025): each sampled token's
    advantage is minus the per-token reverse KL to the teacher, -coef * (log pi(y_t) - log teacher(y_t)),
    so the policy gradient lowers KL(pi || teacher) on the student's own samples. `scored`: 1 on the
    tokens the teacher scored and that carry loss (a model token), 0 elsewhere, where the advantage
    is 0. All [B, T] -> [B, T] float32."""
    scored = scored.to(torch.float32)
    return -coef * (student_logp.to(torch.float32) - teacher_logp.to(torch.float32)) * scored
