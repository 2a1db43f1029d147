"""The learner-recovery policy: whether a dead or hung learner group is restarted, and
from where.

Pure bookkeeping, no Ray: the supervisor asks `LearnerRecovery.decide` once per learner death and
either restarts the group from the returned `RestartPlan` or raises the returned `RunError`.

Without a checkpoint yet the group restarts from the run's initial weights at step 0 rather than
stopping: the initial weights are always on disk, and a stopped run would have to be restarted by
hand from the same place, so restarting is never worse; with `train.checkpoint_every` = N the first
checkpoint comes at step N, so the steps redone stay within N either way.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from async_rl.errors import RunError


class RestartPlan(msgspec.Struct, frozen=True):
    """Where a restarted learner group starts: `checkpoint` (RUN_DIR/checkpoints/step_N, or None for
    the initial weights) and the step index it goes on from (N, or 0)."""

    checkpoint: str | None
    step: int
    recoveries: int  # cumulative, this one included: the `recoveries` metric


def _resume_hint(checkpoint: str | None) -> str:
    return f"resume from checkpoint {checkpoint}" if checkpoint else "no checkpoint was written, the run cannot resume"


class LearnerRecovery:
    """Counts learner recoveries and allows at most `max_recoveries` within any `window_steps` steps
    (0: over the whole run). Owns only its own counts."""

    def __init__(self, mode: Literal["auto", "off"], max_recoveries: int, window_steps: int) -> None:
        if mode not in ("auto", "off"):
            raise ValueError(f"train.recover must be 'auto' or 'off', got {mode!r}")
        if max_recoveries < 0 or window_steps < 0:
            raise ValueError(f"train.max_recoveries ({max_recoveries}) and train.recovery_window_steps "
                             f"({window_steps}) must be >= 0")
        self.mode = mode
        self.max_recoveries = max_recoveries
        self.window_steps = window_steps
        self._at_steps: list[int] = []  # the step index of each recovery so far

    @property
    def recoveries(self) -> int:
        return len(self._at_steps)

    def _in_window(self, step: int) -> int:
        if self.window_steps == 0:
            return len(self._at_steps)
        return sum(1 for s in self._at_steps if step - s < self.window_steps)

    def decide(self, step: int, what: str, checkpoint: str | None, checkpoint_step: int | None) -> RestartPlan | RunError:
        """`what` died or hung (one line, e.g. "learner rank 1 died (...)") during step `step`;
        `checkpoint`/`checkpoint_step`: the newest complete checkpoint and the step it holds, or None.
        A plan to restart the group, or the error that stops the run."""
        if (checkpoint is None) != (checkpoint_step is None):
            raise ValueError("a checkpoint and its step come together")
        if self.mode == "off":
            return RunError(f"{what}; {_resume_hint(checkpoint)} (train.recover is off)")
        if self._in_window(step) >= self.max_recoveries:
            window = f"{self.window_steps} steps" if self.window_steps else "the run"
            return RunError(
                f"{what}; {self._in_window(step)} learner recoveries within {window} already "
                f"(train.max_recoveries {self.max_recoveries}); {_resume_hint(checkpoint)}"
            )
        self._at_steps.append(step)
        return RestartPlan(checkpoint=checkpoint, step=checkpoint_step or 0, recoveries=self.recoveries)
