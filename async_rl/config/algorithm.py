"""The RL algorithm: advantages, losses, KL."""

from __future__ import annotations

from typing import Annotated, Literal

from async_rl.config.base import _f, _Section


class AlgorithmConfig(_Section):
    """The RL algorithm: advantage estimator, policy loss, off-policy corrections, KL, critic."""

    name: Annotated[
        Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "ppo", "opd"],
        _f("grpo (group mean/std), dr_grpo (group mean, loss summed over tokens / a constant), rloo "
           "(leave-one-out baseline), reinforce_pp (REINFORCE++: batch-normalised returns), ppo (critic + GAE), "
           "opd (on-policy distillation: each sampled token's advantage is distill_coef * (log teacher - log pi_old), "
           "the per-token reverse KL to teacher.model, plus distill_rewards' group advantage; needs teacher.model)"),
    ] = "grpo"
    distill_coef: Annotated[
        float, _f("opd: weight of the teacher term -(log pi_old - log teacher) in each token's advantage", ge=0)
    ] = 1.0
    distill_rewards: Annotated[
        Literal["none", "grpo", "dr_grpo", "rloo"],
        _f("opd: the task rewards' group advantage added to every token's teacher term (RL with a teacher's KL); "
           "none = pure distillation (the task's rewards are logged, not trained on)"),
    ] = "none"
    clip_eps_low: Annotated[float, _f("PPO clip: ratio lower bound is 1 - this", ge=0)] = 0.2
    clip_eps_high: Annotated[
        float, _f("PPO clip: ratio upper bound is 1 + this (above clip_eps_low = DAPO clip-higher)", ge=0)
    ] = 0.2
    objective: Annotated[
        Literal["behaviour", "decoupled"],
        _f("behaviour: PPO-clip on pi/mu (mu = vLLM's log-probs), truncated IS in the unclipped term; decoupled: "
           "learner recomputes proximal log-probs, clips pi/pi_prox, weights by truncated pi_prox/mu (AReaL); "
           "pi_prox is the weights before the batch's first update, so the clip acts from its second "
           "(train.minibatches or train.epochs > 1)"),
    ] = "behaviour"
    tis_cap: Annotated[
        float, _f("truncated importance sampling: cap on the importance ratio against vLLM's policy", gt=1)
    ] = 2.0
    ratio_mask_low: Annotated[
        float, _f("tokens whose importance ratio against vLLM's policy is below this are masked out (0 = off)", ge=0)
    ] = 0.0
    ratio_mask_high: Annotated[
        float, _f("tokens whose importance ratio against vLLM's policy is above this are masked out (0 = off)", ge=0)
    ] = 0.0
    dynamic_sampling: Annotated[
        bool, _f("DAPO dynamic sampling: drop (count as filtered) groups whose rewards are all equal and keep "
                 "sampling until the batch is full")
    ] = False
    kl_coef: Annotated[
        float, _f("KL penalty against a frozen copy of the initial weights (0 = no reference model)", ge=0)
    ] = 0.0
    kl_estimator: Annotated[
        Literal["k1", "k2", "k3"],
        _f("KL estimator per token, delta = log pi - log ref: k1 = delta (in the reward only: as a loss its "
           "expected gradient is 0), k2 = delta^2/2 (loss gradient = that of KL(pi||ref)), k3 = exp(-delta) + "
           "delta - 1 (GRPO's; loss gradient = that of KL(ref||pi))"),
    ] = "k3"
    kl_in_reward: Annotated[
        bool, _f("apply the KL penalty per token in the reward (reinforce_pp, ppo) instead of as a loss term")
    ] = False
    entropy_coef: Annotated[
        float, _f("entropy bonus: subtract this times the policy's mean per-token entropy (of the full next-token "
                  "distribution, aggregated like the policy loss) from the loss; raises entropy (0 = off)", ge=0)
    ] = 0.0
    cov_control: Annotated[
        Literal["none", "clip_cov", "kl_cov"],
        _f("covariance-based entropy control (Cui et al. 2025), on the per-token covariance (A - mean A)(log pi_old "
           "- mean log pi_old) over the shard's loss tokens: clip_cov detaches the gradient of a random cov_ratio "
           "fraction of the tokens whose covariance lies in [clip_cov_low, clip_cov_high]; kl_cov adds "
           "kl_cov_coef * |log pi - log pi_old| on the cov_ratio fraction with the highest covariance"),
    ] = "none"
    cov_ratio: Annotated[
        float, _f("cov_control: fraction of the shard's loss tokens selected (at least one token); the paper's 2e-4 "
                  "to 2e-3 assume millions of tokens per batch", gt=0, le=1)
    ] = 2e-3
    clip_cov_low: Annotated[float, _f("cov_control=clip_cov: lower bound of the covariance range")] = 1.0
    clip_cov_high: Annotated[float, _f("cov_control=clip_cov: upper bound of the covariance range")] = 5.0
    kl_cov_coef: Annotated[
        float, _f("cov_control=kl_cov: coefficient of |log pi - log pi_old| on the selected tokens", ge=0)
    ] = 1.0
    gamma: Annotated[float, _f("discount over completion tokens (reinforce_pp returns, ppo GAE)", ge=0, le=1)] = 1.0
    gae_lambda: Annotated[float, _f("ppo: GAE lambda", ge=0, le=1)] = 0.95
    critic_lr: Annotated[float, _f("ppo: learning rate of the value head (own AdamW)", gt=0)] = 1e-3
    critic_hidden: Annotated[
        int, _f("ppo: hidden width of the value head MLP on the policy's last hidden states", ge=1)
    ] = 64
    overlong: Annotated[
        Literal["keep", "mask", "penalty"],
        _f("completions cut at generators.max_tokens (finish reason length): keep (train on them as they "
           "are), mask (they add no loss; their rewards still shape their group's baseline), penalty "
           "(DAPO's soft overlong punishment: a reward penalty rising linearly over the last "
           "overlong_buffer_tokens tokens before max_tokens, to -overlong_penalty at max_tokens)"),
    ] = "keep"
    overlong_buffer_tokens: Annotated[
        int, _f("overlong=penalty: length of the zone before generators.max_tokens where the penalty grows", ge=1)
    ] = 64
    overlong_penalty: Annotated[
        float, _f("overlong=penalty: the penalty at generators.max_tokens (subtracted from the reward)", ge=0)
    ] = 1.0
