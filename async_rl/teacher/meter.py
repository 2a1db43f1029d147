"""The teacher's per-step metrics from the engines' cumulative counters (wire.TeacherCounts): the
tokens scored since the last step per second of the step, and the share of the scored groups' time
spent waiting for the teacher. Engines are keyed by id (never reused within a run), and a replaced
engine's last reported counters stay in the sums: `unscored`, `failures` and `timeouts` only grow,
whatever died. (What a dead engine counted after its last report is lost with it.)"""

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
        self._engines: dict[int, TeacherCounts] = {}  # every engine's last counters, replaced ones too

    def _total(self) -> TeacherCounts:
        total = TeacherCounts()
        for counts in self._engines.values():
            total.add(counts)
        return total

    def step(self, engines: dict[int, TeacherCounts], step_s: float) -> TeacherStep:
        """`engines`: the live engines' cumulative counters by engine id."""
        last = self._total()
        self._engines.update(engines)
        total = self._total()
        tokens = total.tokens - last.tokens
        score_s = total.score_s - last.score_s
        rollout_s = total.rollout_s - last.rollout_s
        return TeacherStep(
            tokens=tokens,
            tokens_per_s=tokens / step_s if step_s > 0 else 0.0,
            share=score_s / (score_s + rollout_s) if score_s + rollout_s > 0 else 0.0,
            unscored=total.unscored,
            failures=total.failures,
            timeouts=total.timeouts,
        )
