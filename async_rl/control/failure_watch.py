"""A run that cannot learn stops: every reward failing (error, timeout, crash), every request or episode
failing (an environment that errors), or an evaluation whose rewards all failed. Partial failure stays
a counter. The supervisor feeds the buffer's cumulative counters after every step and at every health
check while the learner waits; the window is `task.failure_window` samples (0: never stop)."""

from __future__ import annotations

import msgspec

from async_rl.buffer.actor import BufferStats
from async_rl.evaluation.scores import EvalRecord

REWARD_KINDS = ("error", "timeout", "crash")


class FailureWindow:
    """`window` outcomes in a row failed, judged from cumulative counts of successes and failures read
    now and then: the successes did not move while the failures grew by `window` since they last did
    (every outcome counted in between failed). `detail`: other cumulative counts kept from the moment
    the run of failures began (the failures by kind)."""

    def __init__(self, window: int, detail: tuple[int, ...] = ()) -> None:
        self.window = window
        self._ok = 0
        self._failed_at = 0  # failures counted when successes last moved (0: since the start)
        self.detail_at = detail
        self.from_start = True  # no success seen yet

    def observe(self, ok: int, failed: int, detail: tuple[int, ...] = ()) -> bool:
        if ok != self._ok:
            self._ok, self._failed_at, self.detail_at, self.from_start = ok, failed, detail, False
            return False
        return self.window > 0 and failed - self._failed_at >= self.window


class Failing(msgspec.Struct, frozen=True):
    """Why the run stops; `source` says which last error completes the line: 'reward' (the reward
    workers') or 'request' (a failed generation request or episode)."""

    message: str
    source: str


class FailureWatch:
    def __init__(self, window: int, reward_name: str, env_name: str = "") -> None:
        self.window = window
        self.reward_name = reward_name
        self.env_name = env_name
        self._rewards = FailureWindow(window, detail=(0,) * len(REWARD_KINDS))
        self._requests = FailureWindow(window)

    def _where(self, w: FailureWindow) -> str:
        return f"the first {self.window} samples" if w.from_start else f"{self.window} samples in a row"

    def check(self, stats: BufferStats) -> Failing | None:
        a = stats.accounts
        arrived = a.waiting + a.trained + a.dropped_stale + a.filtered  # every sample that reached the buffer
        kinds = (stats.reward_errors, stats.reward_timeouts, stats.reward_crashes)
        failed = sum(kinds)
        if self._rewards.observe(arrived - failed, failed, kinds):
            window = [now - then for now, then in zip(kinds, self._rewards.detail_at, strict=True)]
            kind = REWARD_KINDS[max(range(len(kinds)), key=lambda i: window[i])]
            counts = ", ".join(f"{k} {n}" for k, n in zip(REWARD_KINDS, window, strict=True) if n)
            return Failing(
                f"{self.reward_name} failed on every one of {self._where(self._rewards)} ({kind}; {counts}): "
                f"the run cannot learn (task.failure_window={self.window})",
                "reward",
            )
        if self._requests.observe(arrived, a.lost):
            what = f"every episode of env {self.env_name}" if self.env_name else "every generation request"
            return Failing(
                f"{what} failed: {self._where(self._requests)} were lost and none arrived "
                f"(task.failure_window={self.window})",
                "request",
            )
        return None

    def check_eval(self, record: EvalRecord) -> Failing | None:
        """An evaluation whose every reward failed, or whose every prompt failed to generate."""
        if self.window == 0:
            return None
        if record.samples and record.reward_failures == record.samples:
            return Failing(
                f"evaluation at step {record.step}: {self.reward_name} failed on every one of its {record.samples} samples",
                "reward",
            )
        if record.failed_prompts and not record.samples:
            return Failing(
                f"evaluation at step {record.step}: every one of its {record.failed_prompts} prompts failed", "request"
            )
        return None


def reward_name(task_name: str, reward: str) -> str:
    """How the stop line names the reward: the configured one, or the task's own."""
    return f"the reward task.reward={reward}" if reward else f"the reward of task.name={task_name}"
