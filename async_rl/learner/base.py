"""The learner process boundary: one rank of an SPMD learner group, chosen by `learner.backend`.

Contract shared by every backend (torch DDP/FSDP2, Megatron):

- Methods marked *collective* are called by the controller on every rank of the group at once (a
  sharded backend gathers or all-reduces inside them); the others are called on rank 0 only.
- Parameters cross this boundary under Hugging Face names, full (unsharded) and with a tied output
  embedding listed once under the input embedding's name: that is what vLLM's loader and
  `from_pretrained` expect. A backend with another internal layout converts in `hf_weights`.
- Policy version = batches trained. Step `s` (0-based) trains batch `s` (in train.minibatches x
  train.epochs optimizer steps) and produces version `s + 1`; a checkpoint written after it is
  `step_{s+1}` and holds version `s + 1`.
"""

from __future__ import annotations

import abc
from pathlib import Path

import msgspec
import numpy as np
import torch

from async_rl.protocol import FINISH_LENGTH, EpisodeInfo, TrajectoryGroup
from async_rl.weight_sync.base import UpdateReceipt, WeightGroupInfo
from async_rl.weight_sync.bucketing import Manifest
from async_rl.weight_sync.checksum import ParamChecksum


class MoeMetrics(msgspec.Struct, kw_only=True):
    """An MoE model's routing in one step, over the whole learner group (`learner/moe_metrics.py`)."""

    replay: bool  # learner.routing_replay as it ran
    routed_tokens: int  # input tokens with an engine route, over the step's gradient passes
    unrouted_tokens: int  # tokens of the batch without one (route_missing rows, samples without routes): live router
    # of the routed tokens, those whose live router chose the engine's top-k set in every MoE layer (None:
    # no routed token), and the lowest per-layer agreement, in that layer
    router_agreement: float | None = None
    router_agreement_worst_layer: float | None = None
    worst_layer: int = 0
    expert_load_max_mean: float = 0.0  # tokens of the busiest expert / the mean per expert, in the worst layer
    aux_loss: float = 0.0  # the load-balancing loss (learner.moe_aux_loss_coef > 0), mean over micro-batches
    # learner.routing_probe_samples: mean |learner - engine| log-prob on the probe's model tokens, before
    # the step's first update, with replay on and with the live router (None: no probe)
    mismatch_replay: float | None = None
    mismatch_live: float | None = None


class StepMetrics(msgspec.Struct, kw_only=True):
    step: int
    rank: int
    loss: float
    reward_mean: float
    kl_behav: float
    logprob_abs_diff: float  # |learner - vLLM| over all tokens before the update (includes policy lag)
    grad_norm: float
    clip_frac: float
    tis_frac: float
    samples: int  # episodes trained (a split agent episode's segments count once, as in the buffer)
    tokens: int  # completion tokens of every trained sequence
    wait_s: float  # time spent waiting for the batch
    compute_s: float
    lr: float = 0.0  # learning rate used by this step
    micro_batches: int = 1  # forward/backward passes of the step (all its updates)
    updates: int = 1  # optimizer steps the batch took part in: train.minibatches x train.epochs
    nonfinite_steps: int = 0  # of those, skipped for a non-finite loss or gradient norm (weights kept)
    masked_frac: float = 0.0  # completion tokens masked out for an extreme importance ratio
    kl_ref: float = 0.0  # KL estimate to the frozen reference (0 without algorithm.kl_coef)
    value_loss: float = 0.0  # ppo: the critic's value loss
    entropy: float = 0.0  # mean per-token entropy of the policy over the trained completion tokens
    cov_frac: float = 0.0  # fraction of kept loss tokens the covariance control acted on (algorithm.cov_control)
    # algorithm.name=opd: the batch's mean per-token reverse KL to the teacher (log pi_old - log teacher,
    # over the scored model tokens; the same on every rank) and this rank's samples no teacher scored
    kl_teacher: float = 0.0
    teacher_missing: int = 0
    completion_lens: list[int] = []  # tokens of every completion (sequence) of the shard (length percentiles)
    truncated: int = 0  # completions of the shard cut at max_tokens (finish reason length)
    episodes: list[EpisodeInfo] = []  # multi-turn episodes of the shard: turns and tool counts
    env_tokens: int = 0  # completion tokens of the shard that the environment wrote (no loss)
    across_updates: int = 0  # samples of the shard whose tokens came from more than one policy version
    moe: MoeMetrics | None = None  # MoE models (torch and megatron backends): routing, the same on every rank


def completion_lengths(groups: list[TrajectoryGroup]) -> list[int]:
    return [len(c) for g in groups for c in g.completions]


def episode_rewards(groups: list[TrajectoryGroup]) -> list[float]:
    """One reward per episode (a split agent episode's segments carry the same one)."""
    return [g.rewards[i] for g in groups for i in g.episode_last_samples()]


def _merged(parts: list[EpisodeInfo]) -> EpisodeInfo:
    """One episode's counts from its segments' (a split agent episode: one per segment)."""
    if len(parts) == 1:
        return parts[0]
    return EpisodeInfo(
        turns=sum(p.turns for p in parts),
        tool_calls=sum(p.tool_calls for p in parts),
        tool_errors=sum(p.tool_errors for p in parts),
        tool_timeouts=sum(p.tool_timeouts for p in parts),
        tool_ok=sum(p.tool_ok for p in parts),
        turn_versions=[v for p in parts for v in p.turn_versions],
    )


def episode_infos(groups: list[TrajectoryGroup]) -> list[EpisodeInfo]:
    out = []
    for g in groups:
        if g.episodes is None:
            continue
        index = g.episode_index()
        out += [_merged([e for e, k in zip(g.episodes, index, strict=True) if k == ep]) for ep in range(g.episode_count)]
    return out


def env_token_count(groups: list[TrajectoryGroup]) -> int:
    return sum(int((g.loss_mask(i) == 0).sum()) for g in groups if g.loss_masks is not None for i in range(g.size))


def across_updates_count(groups: list[TrajectoryGroup]) -> int:
    """Episodes generated across a weight update (later turns, or later segments, on newer weights)."""
    count = 0
    for g in groups:
        index = g.episode_index()
        for ep in range(g.episode_count):
            rows = [i for i, k in enumerate(index) if k == ep]
            count += max(g.version_last[i] for i in rows) > min(g.version_first[i] for i in rows)
    return count


def truncated_count(groups: list[TrajectoryGroup]) -> int:
    return sum(fr == FINISH_LENGTH for g in groups for fr in (g.finish_reasons or ()))


class Probe(msgspec.Struct):
    """Token sequences and the learner's log-probs at `positions`, for the vLLM-vs-learner check."""

    token_ids: list[list[int]]
    positions: list[list[int]]
    logprobs: list[list[float]]
    # vision-language samples: each sample's prompt images (empty: a text prompt) and prompt length
    images: list[list[bytes]] = []
    prompt_lens: list[int] = []

    def images_of(self, i: int) -> tuple[list[bytes], int]:
        """Sample i's prompt images and prompt length (none and 0: a text sample)."""
        return (self.images[i], self.prompt_lens[i]) if self.images else ([], 0)

    def mean_abs_diff(self, other: list[list[float]]) -> float:
        """Mean |other - learner| log-prob over the probe's tokens (`other`: an engine's, at `positions`)."""
        diffs = [
            abs(o - lp) for theirs, ours in zip(other, self.logprobs, strict=True) for o, lp in zip(theirs, ours, strict=True)
        ]
        return sum(diffs) / len(diffs) if diffs else 0.0


class LearnerRank(abc.ABC):
    """What the controller calls on each learner rank (rank 0 also sends weights)."""

    @abc.abstractmethod
    def rendezvous_address(self) -> str:
        """Rank 0 only: 'host:port' the other ranks use to form the data-parallel group."""

    @abc.abstractmethod
    def setup(self) -> int:
        """Collective. Join the learner group, build model, optimizer and LR schedule from
        `spec.model_dir`; returns the parameter count."""

    # ---- training ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def train_step(self, step: int) -> StepMetrics:
        """Collective. Fetch this rank's shard of batch `step` from the buffer and `train_on_shard`."""

    @abc.abstractmethod
    def train_on_shard(self, step: int, groups: list[TrajectoryGroup]) -> StepMetrics:
        """Collective. train.minibatches x train.epochs optimizer steps on this rank's shard, cut
        into mini-batches of whole groups (gradients summed over ranks, each the global mini-batch's
        token mean): advantages once, the off-policy loss over micro-batches with gradient
        accumulation, clipping, the LR schedule (per batch). Metrics are this rank's, averaged over
        its updates (the controller averages them over ranks)."""

    @abc.abstractmethod
    def compute_logprobs(self, groups: list[TrajectoryGroup], temperature: float = 1.0) -> list[np.ndarray]:
        """Collective. Current-weight log-probs of every completion token, no gradient: one float32
        array per completion, groups in order, completions in order within a group."""

    @abc.abstractmethod
    def probe_logprobs(self, max_samples: int) -> Probe:
        """Collective (rank 0's answer is used). Current-weight log-probs (temperature 1) on up to
        `max_samples` sequences of the last batch."""

    # ---- weights under HF names -----------------------------------------------------------------

    def gather_weights(self, version: int | None = None) -> bool:
        """Collective. Make the full parameters available to rank 0's `hf_weights` (a sharded backend
        all-gathers and converts here; a replicated one has nothing to do). Called before every
        weight sync and before `param_checksum`; valid until the next optimizer step. Runs under the
        weights lock (never inside an optimizer step). With `version`: False, gathering nothing, when
        this rank already trained past that version (the sync is skipped)."""
        return True  # replicated backends: the parameters are already full on rank 0

    @abc.abstractmethod
    def hf_weights(self) -> dict[str, torch.Tensor]:
        """Rank 0, after `gather_weights`: every parameter, full, under its HF name (tied once)."""

    @abc.abstractmethod
    def weight_manifest(self) -> Manifest: ...

    @abc.abstractmethod
    def open_weight_group(self, world_size: int) -> WeightGroupInfo:
        """Rank 0: host the broadcast rendezvous for `world_size` members (non-blocking)."""

    @abc.abstractmethod
    def join_weight_group(self) -> None:
        """Rank 0: block until every receiver joined."""

    @abc.abstractmethod
    def broadcast_weights(self, version: int, full: bool = False) -> UpdateReceipt:
        """Rank 0, after `gather_weights`: send `hf_weights()` as policy `version` (`full`: never as a
        delta, weight_sync.delta)."""

    @abc.abstractmethod
    def param_checksum(self) -> ParamChecksum:
        """Rank 0, after `gather_weights`: checksum of `hf_weights()`."""

    # ---- checkpoints ------------------------------------------------------------------------------

    @abc.abstractmethod
    def save_checkpoint(self, directory: str) -> None:
        """Collective. Write into `directory` (it exists; the caller commits it atomically):
        `model/` an HF folder (config, tokenizer files, safetensors under HF names) that
        `from_pretrained` and vLLM load directly; the optimizer and LR scheduler state; the step
        count; every rank's RNG state. Rank 0 writes the shared files."""

    @abc.abstractmethod
    def load_checkpoint(self, directory: str) -> int:
        """Collective, after `setup`. Restore what `save_checkpoint` wrote: weights, optimizer,
        scheduler, RNG; the next `train_step` continues bit-exactly. Returns the step count saved."""

    def pin_weights(self, version: int) -> bool:
        """Hold the weights still for a sync if they are `version` (False: the learner moved on)."""
        return True

    def unpin_weights(self) -> None:  # noqa: B027 - optional, a backend without a pin has nothing to do
        """End of the sync that pin_weights started."""

    def redirect_buffer(self, address: str) -> None:
        """The buffer was restarted at `address`; called while train_step may be waiting for a batch."""
        raise NotImplementedError(f"{type(self).__name__} cannot follow a restarted buffer")

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release what the rank holds outside its process (process groups, shared memory)."""


MODEL_SUBDIR = "model"  # the HF folder inside a checkpoint directory


def checkpoint_model_dir(directory: str | Path) -> Path:
    return Path(directory) / MODEL_SUBDIR


ADAPTER_SUBDIR = "adapter"  # learner.lora: the adapter in PEFT's format, instead of `model/`


def checkpoint_adapter_dir(directory: str | Path) -> Path:
    return Path(directory) / ADAPTER_SUBDIR
