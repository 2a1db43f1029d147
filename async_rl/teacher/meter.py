"""The teacher's per-step metrics from the engines' cumulative counters (wire.TeacherCounts): the
tokens scored since the last step per second of the step, and the share of the scored groups' time
spent waiting for the teacher. An engine that was replaced starts its counters at 0: its predecessor's
are gone from the sum, so a step's difference is floored at 0 rather than negative."""

from __future__ import annotations

import msgspec

from async_rl.teacher.wire import TeacherCounts


class TeacherStep(msgspec.Struct, frozen=True):
    tokens: int  # completion tokens scored since the last step
    tokens_per_s: float
    share: float  # score_s / (rollout_s + score_s) of the groups scored since the last step
    unscored: int  # so far
    failures: int  # so far
    timeouts: int  # so far


class TeacherMeter:
    def __init__(self) -> None:
        self._last = TeacherCounts()

    def step(self, engines: list[TeacherCounts], step_s: float) -> TeacherStep:
        total = TeacherCounts()
        for counts in engines:
            total.add(counts)
        tokens = max(0, total.tokens - self._last.tokens)
        score_s = max(0.0, total.score_s - self._last.score_s)
        rollout_s = max(0.0, total.rollout_s - self._last.rollout_s)
        self._last = total
        return TeacherStep(
            tokens=tokens,
            tokens_per_s=tokens / step_s if step_s > 0 else 0.0,
            share=score_s / (score_s + rollout_s) if score_s + rollout_s > 0 else 0.0,
            unscored=total.unscored,
            failures=total.failures,
            timeouts=total.timeouts,
        )
