"""Replacement engines started in the background, so the run goes on with the engines it has.

A vLLM start takes tens of seconds on a CPU and minutes for a large model on a GPU. While a dead
engine's replacement starts, the survivors keep generating and the learner keeps training; the
replacement joins the pool (paused, until a sync gives it the current weights) when its start
returned. A failed start is started again after the engines' backoff (StartRetry, the same bound and
count as a blocking start), without holding up the loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from async_rl.control.start_retry import StartRetry, StartsSpent
from async_rl.generator.pool import GeneratorPool


@dataclass
class Refill:
    """One engine of the pool being started again."""

    what: str  # what it replaces, as the lines name it ("engine(s) replacing [0]")
    attempt: int  # its start under way, or the next one (1-based)
    engine_id: int | None  # the engine starting; None while it waits for its next start
    retry_at: float  # clock time of its next start (while engine_id is None)


@dataclass
class Polled:
    """What one look at the refills found: engines that joined the pool (with what they replace), and
    refills whose every start failed."""

    joined: list[tuple[int, str]]
    spent: list[StartsSpent]


class Refills:
    """The replacements starting in the background; `poll` moves them on without waiting."""

    def __init__(self, starts: StartRetry, say: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.starts = starts
        self._say = say
        self._clock = clock
        self.pending: list[Refill] = []

    def __len__(self) -> int:
        return len(self.pending)

    def launch(self, pool: GeneratorPool, count: int, what: str) -> list[int]:
        """Start `count` replacements in the background; returns the new engines' ids."""
        new = pool.launch(count, paused=True)
        self.pending += [Refill(what, 1, engine_id, 0.0) for engine_id in new]
        return new

    def poll(self, pool: GeneratorPool) -> Polled:
        """Engines whose start returned join the pool; a failed start is counted and started again
        after its backoff, or, its starts spent, given up (in `spent`). A failure the engines' start
        retries do not cover (no room: a RunError) is raised."""
        if not self.pending:
            return Polled([], [])
        joined_ids, failed = pool.poll_starts()
        failed_by = dict(failed)
        out = Polled([], [])
        for refill in list(self.pending):
            engine_id = refill.engine_id
            if engine_id in joined_ids:
                self.pending.remove(refill)
                out.joined.append((engine_id, refill.what))
            elif engine_id in failed_by:
                exc = failed_by[engine_id]
                if not isinstance(exc, self.starts.retry_on):
                    raise exc
                try:
                    wait = self.starts.failed_start(refill.attempt, refill.what, exc, self._say)
                except StartsSpent as spent:
                    self.pending.remove(refill)
                    out.spent.append(spent)
                    continue
                refill.attempt, refill.engine_id, refill.retry_at = refill.attempt + 1, None, self._clock() + wait
            elif engine_id is None and self._clock() >= refill.retry_at:
                refill.engine_id = pool.launch(1, paused=True)[0]
        return out

    def cancel(self, pool: GeneratorPool) -> None:
        """Stop every replacement still starting (the pool is resized, or the run ends)."""
        pool.cancel_starts()
        self.pending.clear()
