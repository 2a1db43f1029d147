"""Starting a process again when its start fails, with backoff, up to a bound.

On GPUs a replacement engine failing at start is common (the dead engine's memory not yet freed: an
out-of-memory at load; an NCCL or port set-up failing once), and on any machine a second fault can
hit a replacement while it initializes (its engine core killed). Each of these is retried; what a
start that can never succeed raises (no room in the placement: a RunError) is not.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from async_rl.config import Config
from async_rl.control.remote_cause import cause_line
from async_rl.errors import RunError

T = TypeVar("T")


class StartsSpent(RunError):
    """Every allowed start of a process failed; the message names it and the last cause."""


class StartRetry:
    """`run(start, what)` calls `start` until it returns, at most `attempts` times, waiting `backoff_s`
    before the second call and twice as long before each later one. `failed` counts the failed starts
    over the run (the step metrics' `failed_starts`)."""

    def __init__(self, attempts: int, backoff_s: float, retry_on: tuple[type[BaseException], ...],
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.retry_on = retry_on
        self.failed = 0
        self._sleep = sleep

    def run(self, start: Callable[[], T], what: str, say: Callable[[str], None]) -> T:
        """`say` gets one line per failed start that will be retried."""
        for attempt in range(1, self.attempts + 1):
            try:
                return start()
            except self.retry_on as exc:
                self._sleep(self.failed_start(attempt, what, exc, say))
        raise AssertionError("unreachable: attempts >= 1")

    def failed_start(self, attempt: int, what: str, exc: BaseException, say: Callable[[str], None]) -> float:
        """Start `attempt` (1-based) of `what` failed with `exc`: it is counted, and the seconds to wait
        before the next start are returned (a line says so); StartsSpent when it was the last allowed.
        A start made in the background (Supervisor.poll_refills) reports its failure here too."""
        self.failed += 1
        cause = cause_line(exc)  # the remote exception, not Ray's wrapping
        if attempt >= self.attempts:
            raise StartsSpent(f"{what}: {self.attempts} start(s) failed, the last with: {cause}") from exc
        wait = self.backoff_s * 2 ** (attempt - 1)
        say(f"{what}: start {attempt} of {self.attempts} failed ({cause}); starting again in {wait:.0f}s")
        return wait


def engine_starts(cfg: Config) -> StartRetry:
    """The engines' start retries (generators.start_attempts, start_backoff_s): a start that raises a
    Ray error (the actor or its engine core died, an out-of-memory at load) or times out."""
    import ray

    g = cfg.generators
    return StartRetry(g.start_attempts, g.start_backoff_s, (ray.exceptions.RayError, TimeoutError))
