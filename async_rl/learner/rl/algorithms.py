"""The RL algorithm chosen by the `algorithm` config section, as two calls a learner backend makes per
step: `prepare` (advantages, and the extra no-grad passes the algorithm needs) before its forward
pass, and `loss` on the log-probs of that forward pass. The math lives in advantages.py and losses.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import msgspec
import torch
import torch.distributed as dist

from async_rl.config import AlgorithmConfig
from async_rl.learner.batch.cut import ONE_MICRO_BATCH, MicroBatchCut
from async_rl.learner.model.head import DEFAULT_CHUNK
from async_rl.learner.rl.advantages import (
    discounted_returns,
    distill_advantages,
    dr_grpo_advantages,
    gae,
    grpo_advantages,
    masked_whiten,
    overlong_penalty,
    rloo_advantages,
    token_rewards,
)
from async_rl.learner.rl.critic import Critic
from async_rl.learner.rl.losses import (
    covariance_selection,
    kl_estimate,
    kl_penalty_term,
    policy_loss_terms,
    token_covariance,
)
from async_rl.learner.rl.reference import ReferencePolicy, RowShare

if TYPE_CHECKING:
    from async_rl.learner.batch.packing import MicroBatch

GROUP_ESTIMATORS = {"grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages, "rloo": rloo_advantages}


class TokenBatch(Protocol):
    """A learner shard as padded tensors; loss positions index the targets (inputs shifted by one)."""

    input_ids: torch.Tensor  # [B, T + 1]
    attention_mask: torch.Tensor  # [B, T + 1]
    behav_logp: torch.Tensor  # [B, T] vLLM's log-probs at completion positions
    loss_mask: torch.Tensor  # [B, T] 1 on completion positions
    rewards: torch.Tensor  # [groups, n] one per episode, groups in row order
    # [B] long: each row's episode, flat over `rewards` (arange(B) when every row is an episode; a
    # split agent episode's segments are several rows of one episode)
    episode_rows: torch.Tensor
    completion_lens: torch.Tensor  # [B] completion tokens per row
    truncated: torch.Tensor  # [B] bool: finish reason length (cut at max_tokens)
    teacher_logp: torch.Tensor  # [B, T] the teacher's log-probs at completion positions (0 where unscored)
    teacher_mask: torch.Tensor  # [B, T] 1 where the teacher scored the token
    # int32 [B, T + 1, moe_layers, top_k]: an MoE shard's recorded routes per input token (batch/routes.py),
    # None without; read by the reference pass when it replays them
    routes: torch.Tensor | None


class AlgoStats(msgspec.Struct, kw_only=True):
    loss: float  # the total loss (policy + KL term)
    policy_loss: float
    clip_frac: float
    tis_frac: float
    masked_frac: float
    kl_behav: float
    logprob_abs_diff: float
    kl_ref: float  # mean per-token KL estimate to the reference (0 without one)
    value_loss: float  # ppo: the critic's loss before its step (0 otherwise)
    cov_frac: float = 0.0  # fraction of kept tokens the covariance control acted on (clip_cov / kl_cov)


# The order of `Algorithm.loss_terms`' statistics vector: AlgoStats' fields but value_loss (the
# policy-loss statistics in losses.POLICY_STATS' order after the total, then kl_ref and cov_frac).
LOSS_STATS = ("loss", "policy_loss", "clip_frac", "tis_frac", "masked_frac", "kl_behav", "logprob_abs_diff",
              "kl_ref", "cov_frac")


@dataclass
class Prepared:
    """What `loss` needs besides the trained log-probs, for one shard (or a slice of its rows)."""

    behav_logp: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor  # [B, T] or [B, 1]
    prox_logp: torch.Tensor | None  # decoupled objective only
    ref_logp: torch.Tensor | None  # KL penalty as a loss term only
    denominator: float  # the global batch's (all data-parallel ranks): its completion tokens or Dr.GRPO's constant
    kl_ref: float
    value_loss: float
    # cov_control: the tokens it acts on, 0/1 [B, T] (selected once per batch, on the old log-probs).
    cov_select: torch.Tensor | None = None
    # Whether the global batch's loss has any gradient: False when every advantage on a loss token is
    # 0 (all groups uniform) and no KL term is in the loss. Such a batch takes no optimizer step.
    signal: bool = True
    # [B] 1.0 on each episode's first row (None: every row is an episode): Dr.GRPO counts episodes.
    episode_first: torch.Tensor | None = None
    # opd: the global batch's mean per-token reverse KL to the teacher, log pi_old - log teacher, over
    # the scored loss tokens (their count beside it); 0 and 0 without a teacher
    kl_teacher: float = 0.0
    teacher_tokens: float = 0.0

    def rows(self, sl: slice) -> Prepared:
        """The shard's rows `sl`, every batch-level value the shard's (`Algorithm.minibatch` then
        makes the denominator and signal the mini-batch's)."""

        def cut(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x[sl]

        return Prepared(
            behav_logp=self.behav_logp[sl],
            mask=self.mask[sl],
            advantages=self.advantages[sl],
            prox_logp=cut(self.prox_logp),
            ref_logp=cut(self.ref_logp),
            cov_select=cut(self.cov_select),
            denominator=self.denominator,
            kl_ref=self.kl_ref,
            value_loss=self.value_loss,
            signal=self.signal,
            episode_first=cut(self.episode_first),
            kl_teacher=self.kl_teacher,
            teacher_tokens=self.teacher_tokens,
        )

    def for_micro_batch(self, mb: MicroBatch) -> Prepared:
        """The loss inputs of a (packed or padded) micro-batch built from this shard's samples: its
        per-token tensors come with it; the denominator and batch-level values stay the shard's."""
        return Prepared(
            behav_logp=mb.behav_logp,
            mask=mb.loss_mask,
            advantages=mb.advantages,
            prox_logp=mb.prox_logp,
            ref_logp=mb.ref_logp,
            cov_select=mb.cov_select,
            denominator=max(self.denominator, 1.0),
            kl_ref=self.kl_ref,
            value_loss=self.value_loss,
            signal=self.signal,
        )


# policy_scorer(with_hidden) -> the current policy's no-grad log-probs [B, T] on the shard being
# prepared (and its last hidden states [B, T, H] when asked): how `prepare` reaches the model backend.
PolicyScorer = Callable[[bool], "tuple[torch.Tensor, torch.Tensor | None]"]


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(targets) under logits/temperature. logits [B, T, V], targets [B, T] -> [B, T] (float32)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def score_tokens(
    model: torch.nn.Module, b: TokenBatch, temperature: float, with_hidden: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """No-grad log-probs [B, T] (and last hidden states [B, T, H] aligned with them) of `model`."""
    with torch.no_grad():
        out = model(input_ids=b.input_ids, attention_mask=b.attention_mask, output_hidden_states=with_hidden)
        logp = token_logprobs(out.logits[:, :-1], b.input_ids[:, 1:], temperature)
        hidden = out.hidden_states[-1][:, :-1] if with_hidden else None
    return logp, hidden


def data_parallel_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the learner's data-parallel ranks (identity on one rank)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        x = x.clone()
        dist.all_reduce(x)
    return x


class Algorithm:
    def __init__(
        self,
        cfg: AlgorithmConfig,
        *,
        max_tokens: int,
        temperature: float,
        model_dir: str,
        dtype: torch.dtype,
        hidden_size: int,
        seed: int,
        max_grad_norm: float,
        device: torch.device | str = "cpu",
        cut: MicroBatchCut = ONE_MICRO_BATCH,
        logprob_chunk_tokens: int = DEFAULT_CHUNK,
        base_reference: ReferencePolicy | None = None,
        head_kernel: str = "eager",
        routing_replay: bool = False,
        reference_share: RowShare | None = None,
    ) -> None:
        """`device`: where the reference model and the critic live (the learner backend's device);
        `reference_share`: the SP group a loaded reference shares the shard's micro-batches with;
        `cut`, `logprob_chunk_tokens`, `head_kernel`: the reference pass's micro-batches (the learner's cut,
        `batch/cut.py`), head chunks and head arithmetic (the `learner` fields); `routing_replay`: an MoE
        reference replays the shard's recorded routes, as the policy does."""
        self.cfg = cfg
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.reference = None
        if cfg.kl_coef > 0:  # `base_reference`: the trained model's own frozen base (LoRA), else a loaded copy
            self.reference = base_reference or ReferencePolicy(
                model_dir, dtype, device, cut=cut, logprob_chunk_tokens=logprob_chunk_tokens, head_kernel=head_kernel,
                routing_replay=routing_replay, share=reference_share,
            )
        self.critic = (
            Critic(hidden_size, cfg.critic_hidden, cfg.critic_lr, seed, max_grad_norm, device)
            if cfg.name == "ppo"
            else None
        )
        # Clip-Cov's random choice among the tokens in its covariance range.
        self._cov_rng = torch.Generator().manual_seed(seed)

    def prepare(
        self,
        b: TokenBatch,
        policy: PolicyScorer,
        reduce: Callable[[torch.Tensor], torch.Tensor] = data_parallel_sum,
    ) -> Prepared:
        """Advantages for the shard, and the no-grad passes the algorithm needs: the proximal log-probs
        (decoupled objective: the current weights, before this update), the reference log-probs (KL),
        the policy's hidden states for the critic (ppo, whose value head takes its step here).
        `reduce` sums over the data-parallel ranks (batch-wide whitening, the global denominator)."""
        c = self.cfg
        mask = b.loss_mask
        rewards = b.rewards  # per episode; `rows` maps each row (sequence) to its episode
        rows = b.episode_rows
        if c.overlong == "penalty":
            # A split episode's length is its longest segment's (each segment is one sequence).
            lengths = torch.zeros(rewards.numel(), dtype=b.completion_lens.dtype).scatter_reduce(
                0, rows, b.completion_lens, "amax", include_self=False
            )
            rewards = rewards + overlong_penalty(
                lengths.reshape(rewards.shape), self.max_tokens, c.overlong_buffer_tokens, c.overlong_penalty
            )
        elif c.overlong == "mask":
            # Truncated samples add no loss (and do not count in the token mean); their rewards still
            # enter the group statistics, as in DAPO's overlong filtering.
            mask = mask * (~b.truncated).to(mask.dtype).unsqueeze(1)
        prox = hidden = ref = None
        if c.objective == "decoupled" or self.critic is not None:
            prox, hidden = policy(self.critic is not None)
        if self.reference is not None:
            ref = self.reference.score(b, self.temperature)
        kl_ref, vloss = 0.0, 0.0
        kl_tokens = None
        if ref is not None and c.kl_in_reward:
            # KL of the policy that sampled (the proximal one when recomputed) to the reference.
            old = prox if prox is not None else b.behav_logp
            kl_tokens = kl_estimate(old, ref, c.kl_estimator)
            kl_ref = float((kl_tokens * mask).sum() / mask.sum().clamp(min=1.0))
        kl_teacher = teacher_tokens = 0.0
        if c.name == "opd":
            # The student's log-probs are those of the policy that sampled (the proximal one when
            # recomputed), as the KL-in-reward term takes them: the advantage is fixed for the batch.
            old = prox if prox is not None else b.behav_logp
            scored = b.teacher_mask * mask
            advantages = distill_advantages(old, b.teacher_logp, scored, c.distill_coef)
            if c.distill_rewards != "none":
                group = GROUP_ESTIMATORS[c.distill_rewards](rewards).reshape(-1)[rows].reshape(-1, 1)
                advantages = advantages + group * mask
            kl_sum, teacher_tokens = reduce(
                torch.stack([((old - b.teacher_logp) * scored).sum(), scored.sum()]).to(torch.float64)
            ).tolist()
            kl_teacher = kl_sum / max(teacher_tokens, 1.0)
        elif c.name in GROUP_ESTIMATORS:
            # Group statistics over episodes (one reward each), then each row gets its episode's.
            advantages = GROUP_ESTIMATORS[c.name](rewards).reshape(-1)[rows].reshape(-1, 1)
            if c.overlong == "mask":
                advantages = advantages * mask.amax(dim=1, keepdim=True)
        else:
            # Each row (a split episode's segments too) ends with its episode's reward.
            rewards = token_rewards(rewards.reshape(-1)[rows], mask, kl_tokens, c.kl_coef)
            if c.name == "reinforce_pp":
                advantages = masked_whiten(
                    discounted_returns(rewards, mask, c.gamma), mask, reduce
                )
            else:  # ppo
                values = self.critic.values(hidden)
                raw, returns = gae(rewards, values, mask, c.gamma, c.gae_lambda)
                vloss = self.critic.update(hidden, returns, mask)
                advantages = masked_whiten(raw, mask, reduce)
        kl_loss = ref is not None and not c.kl_in_reward
        first = torch.ones(len(rows))
        first[1:] = (rows[1:] != rows[:-1]).to(first.dtype)
        denominator, signal = self._totals(mask, advantages, kl_loss, reduce, first)
        cov_select = None
        if c.cov_control != "none":
            # The covariance of the policy before this update (the proximal one when recomputed, else
            # vLLM's), as in the paper's entropy-change estimate; the selection is per shard.
            old = prox if prox is not None else b.behav_logp
            cov = token_covariance(old, advantages, mask, reduce)
            cov_select = covariance_selection(
                cov, mask, c.cov_control, c.cov_ratio, c.clip_cov_low, c.clip_cov_high, self._cov_rng
            )
        return Prepared(
            behav_logp=b.behav_logp,
            mask=mask,
            advantages=advantages,
            prox_logp=prox if c.objective == "decoupled" else None,
            ref_logp=ref if kl_loss else None,
            cov_select=cov_select,
            denominator=denominator,
            kl_ref=kl_ref,
            value_loss=vloss,
            signal=signal,
            episode_first=first,
            kl_teacher=kl_teacher,
            teacher_tokens=teacher_tokens,
        )

    def minibatch(
        self, p: Prepared, rows: slice, reduce: Callable[[torch.Tensor], torch.Tensor] = data_parallel_sum
    ) -> Prepared:
        """Rows `rows` (whole groups) of a prepared shard as the inputs of one optimizer step
        (`train.minibatches`): advantages and the old and proximal log-probs stay the shard's, computed
        once; the denominator and the signal become the global mini-batch's (these rows and the other
        ranks' mini-batch of the same index), so each update is the token mean over its mini-batch.
        Collective: one all-reduce, on every rank for every mini-batch."""
        part = p.rows(rows)
        part.denominator, part.signal = self._totals(
            part.mask, part.advantages, part.ref_logp is not None, reduce, part.episode_first
        )
        return part

    def _totals(
        self,
        mask: torch.Tensor,
        advantages: torch.Tensor,
        kl_loss: bool,
        reduce: Callable[[torch.Tensor], torch.Tensor],
        episode_first: torch.Tensor | None = None,
    ) -> tuple[float, bool]:
        """(denominator, signal) of the global batch whose rows on this rank are `mask`
        (`episode_first`: 1 on each episode's first row; None: every row is an episode)."""
        # The loss is a sum over tokens / the global batch's denominator on every rank; the backend sums
        # gradients over ranks, so the update is the global batch's token mean, however unequal the
        # ranks' token counts (a per-rank mean averaged over ranks would weight short shards up).
        # Signal: loss tokens with a non-zero advantage (a KL term in the loss always has a gradient).
        # A batch without any must not step AdamW: a zero-gradient step still moves the weights along
        # the stale momentum and decays the second moment, so the next small gradient takes a
        # full-size step. On a converged policy (most groups uniform) that pair of steps made the
        # quickstart collapse (KL to behaviour 0.35-0.67 right after zero-gradient steps).
        live = 1.0 if kl_loss else float(((advantages != 0).to(mask.dtype) * mask).sum())
        episodes = float(mask.shape[0]) if episode_first is None else float(episode_first.sum())
        n_seq, n_tok, n_signal = reduce(
            torch.tensor([episodes, float(mask.sum()), live], dtype=torch.float64)
        ).tolist()
        # Dr.GRPO: sum over tokens / (episodes * max completion length), the same constant for every
        # batch, so a long completion is not down-weighted per token (a split agent episode counts
        # once: its segments' tokens weigh what they would in one sequence). Otherwise the token mean over
        # the global batch's completion tokens; tokens masked for an extreme ratio add 0 but still
        # count, so the loss of the batch is the sum of its micro-batches' losses.
        return (n_seq * self.max_tokens if self.cfg.name == "dr_grpo" else n_tok), n_signal > 0

    def loss(
        self, p: Prepared, logp: torch.Tensor, entropy: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, AlgoStats]:
        """The loss of a micro-batch from its trained log-probs [B, T] and, for the entropy bonus, the
        policy's entropies [B, T] with their gradient (`entropy_coef` > 0 needs them). The statistics
        are read to the host here: `loss_terms` leaves them on the device."""
        total, stats = self.loss_terms(p, logp, entropy)
        return total, AlgoStats(**dict(zip(LOSS_STATS, stats.tolist(), strict=True)), value_loss=p.value_loss)

    def loss_terms(
        self, p: Prepared, logp: torch.Tensor, entropy: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`loss` with its statistics as a float tensor [len(LOSS_STATS)] on the loss's device (no host
        read: a step reads its micro-batches' statistics once)."""
        c = self.cfg
        total, kept, st = policy_loss_terms(
            logp,
            p.behav_logp,
            p.advantages,
            p.mask,
            eps_low=c.clip_eps_low,
            eps_high=c.clip_eps_high,
            tis_cap=c.tis_cap,
            prox_logp=p.prox_logp,
            ratio_mask_low=c.ratio_mask_low,
            ratio_mask_high=c.ratio_mask_high,
            denominator=p.denominator,
            clip_cov=p.cov_select if c.cov_control == "clip_cov" else None,
            kl_cov=p.cov_select if c.cov_control == "kl_cov" else None,
            kl_cov_coef=c.kl_cov_coef,
        )
        if c.entropy_coef > 0:
            if entropy is None:
                raise ValueError("algorithm.entropy_coef > 0 needs the policy's entropies in the loss")
            # Aggregated like the policy loss (sum over kept tokens / the same denominator).
            total = total - c.entropy_coef * (entropy * kept).sum() / torch.as_tensor(p.denominator).clamp(min=1.0)
        kl_ref = torch.as_tensor(p.kl_ref, dtype=st.dtype, device=st.device)
        if p.ref_logp is not None:
            term = kl_penalty_term(logp, p.ref_logp, kept, c.kl_estimator, p.denominator)
            total = total + c.kl_coef * term
            kl_ref = term.detach().to(st.dtype)
        # st: POLICY_STATS = the policy loss, clip_frac ... logprob_abs_diff (LOSS_STATS[1:7]), cov_frac.
        stats = torch.cat([total.detach().to(st.dtype).reshape(1), st[:6], kl_ref.reshape(1), st[6:]])
        return total, stats

    def state_dict(self) -> dict:
        """What a checkpoint must keep besides the policy and its optimizer: the critic (ppo)."""
        return {"critic": self.critic.state_dict()} if self.critic is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
