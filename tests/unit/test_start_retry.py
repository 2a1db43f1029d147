"""A start that fails is tried again with doubling backoff, up to the bound; a start that cannot succeed
(no room: a RunError) is not retried (async_rl/control/start_retry.py)."""

from __future__ import annotations

import pytest

from async_rl.control.start_retry import StartRetry, StartsSpent
from async_rl.errors import RunError


class Flaky:
    """Fails its first `failures` calls with `error`, then returns the engine ids it started."""

    def __init__(self, failures: int, error: BaseException) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    def __call__(self) -> list[int]:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return [7]


def retry(attempts: int, waits: list[float]) -> StartRetry:
    return StartRetry(attempts, 5.0, (TimeoutError, ConnectionError), sleep=waits.append)


def test_failed_starts_are_retried_with_doubling_backoff_and_counted():
    waits: list[float] = []
    lines: list[str] = []
    r = retry(4, waits)
    start = Flaky(3, ConnectionError("Engine core initialization failed. Failed core proc(s): {'EngineCore': -9}\nmore"))
    assert r.run(start, "engine(s) replacing [0]", lines.append) == [7]  # three failed starts, then one that works
    assert start.calls == 4 and waits == [5.0, 10.0, 20.0] and r.failed == 3
    assert lines[0] == ("engine(s) replacing [0]: start 1 of 4 failed (Engine core initialization failed. "
                        "Failed core proc(s): {'EngineCore': -9}); starting again in 5s")


def test_when_every_start_fails_the_error_names_the_process_and_the_last_cause():
    waits: list[float] = []
    r = retry(3, waits)
    with pytest.raises(StartsSpent, match=r"^engine\(s\) replacing \[1\]: 3 start\(s\) failed, the last with: out of memory$"):
        r.run(Flaky(5, TimeoutError("out of memory")), "engine(s) replacing [1]", lambda line: None)
    assert waits == [5.0, 10.0] and r.failed == 3
    assert issubclass(StartsSpent, RunError)  # the operator and autoscale paths answer it, never crash


def test_a_start_that_cannot_succeed_is_not_retried():
    r = retry(3, [])
    start = Flaky(1, RunError("every GPU of the shared pool already holds an engine"))
    with pytest.raises(RunError, match="shared pool"):
        r.run(start, "1 added engine(s)", lambda line: None)
    assert start.calls == 1 and r.failed == 0
