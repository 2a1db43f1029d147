"""What crosses the boundary between an engine and a teacher replica: one scoring call per group over
HTTP (`POST /v1/score`, msgpack bodies, the run's key). Token ids and log-probs travel as raw
little-endian buffers (int32, float32), as in the trajectory frames; the counters the engines keep."""

from __future__ import annotations

import msgspec
import numpy as np

from async_rl.protocol import LOGPROB_DTYPE, TOKEN_DTYPE

TEACHER = "teacher"  # RewardEndpoint.kind of a teacher replica


class ScoreRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Score each completion after the shared prompt: the teacher's log-prob of every completion token."""

    prompt: bytes  # int32 token ids
    completions: list[bytes]  # int32 token ids each


class ScoreReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    logprobs: list[bytes]  # float32, one per completion token, per completion


def ids_bytes(tokens) -> bytes:
    return np.asarray(tokens, dtype=TOKEN_DTYPE).tobytes()


def ids_of(raw: bytes, what: str) -> list[int]:
    """Token ids from a raw buffer; ValueError (one line) for a buffer that is not whole int32s."""
    if len(raw) % TOKEN_DTYPE.itemsize:
        raise ValueError(f"{what}: {len(raw)} bytes is not a whole number of int32 token ids")
    return np.frombuffer(raw, dtype=TOKEN_DTYPE).tolist()


def logprobs_of(raw: bytes, n: int, what: str) -> np.ndarray:
    """`n` teacher log-probs from a raw buffer, checked: the count, finite, never positive."""
    values = np.frombuffer(raw, dtype=LOGPROB_DTYPE) if len(raw) % LOGPROB_DTYPE.itemsize == 0 else None
    if values is None or len(values) != n:
        raise ValueError(f"{what}: {len(raw)} bytes of log-probs for {n} tokens")
    if n and not bool((np.isfinite(values) & (values <= 1e-3)).all()):
        raise ValueError(f"{what}: log-probs must be finite and <= 0")
    return values


class TeacherCounts(msgspec.Struct):
    """One engine's teacher calls since its start (cumulative; the controller takes per-step deltas)."""

    groups: int = 0  # groups scored
    samples: int = 0  # samples scored
    tokens: int = 0  # completion tokens scored
    unscored: int = 0  # samples pushed without a score after teacher.max_wait_s (no distillation signal)
    failures: int = 0  # calls that failed (an error answer, no connection, no replica): tried again
    timeouts: int = 0  # calls past teacher.timeout_s: tried again
    score_s: float = 0.0  # time groups spent waiting for their score (calls and retries)
    rollout_s: float = 0.0  # time the same groups spent being generated and rewarded before it

    def add(self, other: TeacherCounts) -> None:
        for field in self.__struct_fields__:
            setattr(self, field, getattr(self, field) + getattr(other, field))
