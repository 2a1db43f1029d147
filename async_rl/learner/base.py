"""The learner process boundary: one rank of an SPMD learner group, chosen by `learner.backend`."""

from __future__ import annotations

import abc

import msgspec

from async_rl.security import ClientKeys
from async_rl.weight_sync.base import UpdateReceipt, WeightGroupInfo
from async_rl.weight_sync.bucketing import Manifest
from async_rl.weight_sync.checksum import ParamChecksum


class LearnerSettings(msgspec.Struct, frozen=True):
    model_dir: str
    dtype: str
    lr: float
    weight_decay: float
    max_grad_norm: float
    clip_eps_low: float
    clip_eps_high: float
    tis_cap: float
    temperature: float
    seed: int
    run_id: str
    buffer_address: str
    batch_timeout_s: float
    bucket_mb: int
    weight_sync_host: str
    weight_sync_port: int
    weight_sync_timeout_s: float
    weight_sync_backend: str  # resolved: 'gloo' or 'shm'
    weight_checksum: bool
    wire_dtype: str  # '' = the learner's dtype
    curve: ClientKeys | None = None  # the learner's CURVE keys for the buffer (None: security.curve off)


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
    samples: int
    tokens: int
    wait_s: float  # time spent waiting for the batch
    compute_s: float


class Probe(msgspec.Struct):
    """Token sequences and the learner's log-probs at `positions`, for the vLLM-vs-learner check."""

    token_ids: list[list[int]]
    positions: list[list[int]]
    logprobs: list[list[float]]


class LearnerRank(abc.ABC):
    """What the controller calls on each learner rank (rank 0 also sends weights)."""

    @abc.abstractmethod
    def rendezvous_address(self) -> str:
        """Rank 0 only: 'host:port' the other ranks use to form the data-parallel group."""

    @abc.abstractmethod
    def setup(self) -> int:
        """Join the data-parallel group, build model and optimizer; returns the parameter count."""

    @abc.abstractmethod
    def train_step(self, step: int) -> StepMetrics:
        """Fetch this rank's shard of batch `step` from the buffer and take one optimizer step."""

    @abc.abstractmethod
    def probe_logprobs(self, max_samples: int) -> Probe:
        """Current-weight log-probs on up to `max_samples` sequences of the last batch."""

    @abc.abstractmethod
    def weight_manifest(self) -> Manifest: ...

    @abc.abstractmethod
    def open_weight_group(self, world_size: int) -> WeightGroupInfo:
        """Rank 0: host the broadcast rendezvous for `world_size` members (non-blocking)."""

    @abc.abstractmethod
    def join_weight_group(self) -> None:
        """Rank 0: block until every receiver joined."""

    @abc.abstractmethod
    def broadcast_weights(self, version: int) -> UpdateReceipt: ...

    @abc.abstractmethod
    def param_checksum(self) -> ParamChecksum: ...

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release what the rank holds outside its process (process groups, shared memory)."""
