"""Advantage estimators and the off-policy policy loss. Pure tensor functions, unit-tested by hand."""

from __future__ import annotations

import msgspec
import torch


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


class LossStats(msgspec.Struct):
    loss: float
    clip_frac: float  # fraction of tokens where the clipped term was active
    tis_frac: float  # fraction of tokens whose ratio hit the truncation cap
    kl_behav: float  # k3 estimate of KL(behaviour || current) on the sampled tokens
    logprob_abs_diff: float  # mean |logp_learner - logp_vllm| before the update


def ppo_clip_loss(
    logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    tis_cap: float,
) -> tuple[torch.Tensor, LossStats]:
    """PPO-clip on the behaviour policy with a truncated importance ratio; token-mean over `mask`.

    ratio r = pi/mu (mu = vLLM's behaviour log-probs). Per token:
        loss = -min(min(r, C) * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
    Truncating r at C bounds the loss of negative-advantage tokens whose ratio has exploded (for
    A > 0 the clip already bounds it), which keeps stale or mismatched samples from dominating.
    All inputs are [batch, tokens]; `advantages` is broadcast per sequence by the caller.
    """
    mask = mask.to(logp.dtype)
    denom = mask.sum().clamp(min=1.0)
    log_ratio = logp - behav_logp
    ratio = torch.exp(log_ratio)
    truncated = torch.clamp(ratio, max=tis_cap)
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    surrogate = torch.minimum(truncated * advantages, clipped * advantages)
    loss = -(surrogate * mask).sum() / denom
    with torch.no_grad():
        clip_active = (clipped * advantages < truncated * advantages).to(logp.dtype)
        lr = log_ratio.detach()
        stats = LossStats(
            loss=float(loss.detach()),
            clip_frac=float((clip_active * mask).sum() / denom),
            tis_frac=float(((ratio > tis_cap).to(logp.dtype) * mask).sum() / denom),
            kl_behav=float(((torch.exp(lr) - 1 - lr) * mask).sum() / denom),
            logprob_abs_diff=float((lr.abs() * mask).sum() / denom),
        )
    return loss, stats


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(targets) under logits/temperature. logits [B, T, V], targets [B, T] -> [B, T] (float32)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
