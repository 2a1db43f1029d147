"""A dead engine's replacement starts in the background while the survivors generate; a failed start is
started again after its backoff without holding up the loop; with no engine left the run waits and
says so once; the run's end waits for replacements still starting (async_rl/control/refills.py and
Supervisor.replace / poll_refills / finish_refills)."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from async_rl.config import load_config
from async_rl.control.supervisor import Supervisor
from async_rl.errors import RunError
from tests.unit.test_death_notice import Actor, Runtime


class StartingPool:
    """A generator pool whose engine starts end at the next look (poll_starts); the first `failures`
    launched engines fail to start."""

    def __init__(self, engines: list[int], failures: int = 0) -> None:
        self.engines = {eid: SimpleNamespace(actor=Actor(f"engine{eid}"), started=True) for eid in engines}
        self.starting: list[int] = []
        self.failures, self.launched, self.next_id = failures, 0, max(engines) + 1
        self.cancelled: list[int] = []
        self.stats = lambda: []

    def drop_dead(self, engine_id: int) -> int:
        del self.engines[engine_id]
        return 2  # leased prompts handed back

    def _new(self, count: int) -> list[int]:
        new = list(range(self.next_id, self.next_id + count))
        self.next_id += count
        return new

    def launch(self, count: int, paused: bool) -> list[int]:
        new = self._new(count)
        self.starting += new
        return new

    def poll_starts(self) -> tuple[list[int], list[tuple[int, BaseException]]]:
        joined, failed = [], []
        for eid in self.starting:
            self.launched += 1
            if self.launched <= self.failures:
                failed.append((eid, TimeoutError("engine core killed while it initialized")))
            else:
                self.engines[eid] = SimpleNamespace(actor=Actor(f"engine{eid}"), started=True)
                joined.append(eid)
        self.starting = []
        return joined, failed

    def cancel_starts(self) -> None:
        self.cancelled += self.starting
        self.starting = []

    def add(self, count: int, paused: bool) -> list[int]:  # a blocking start (colocated)
        self.launched += 1
        if self.launched <= self.failures:
            raise TimeoutError("engine core killed while it initialized")
        new = self._new(count)
        self.engines.update({eid: SimpleNamespace(actor=Actor(f"engine{eid}"), started=True) for eid in new})
        return new


def supervisor(tmp_path, pool: StartingPool, *overrides: str) -> tuple[Supervisor, io.StringIO, list[int]]:
    rt = Runtime()
    rt.generators = pool
    cfg = load_config(None, ["generators.num_engines=2", "generators.start_backoff_s=0", "generators.start_attempts=3",
                             "generators.health_check_s=100000", *overrides])
    stream = io.StringIO()
    sup = Supervisor(rt, cfg, tmp_path, "run", stream)
    synced: list[int] = []
    sup.sync = lambda version, during_step=False: synced.append(version)
    return sup, stream, synced


def test_with_a_survivor_the_replacement_starts_in_the_background_and_joins_at_a_later_look(tmp_path):
    pool = StartingPool([0, 1])
    sup, stream, _ = supervisor(tmp_path, pool)
    try:
        sup.replace(3, [1])
        assert list(pool.engines) == [0] and pool.starting == [2]  # the loop goes on with engine 0
        assert not sup.sync_owed
        sup.poll_refills(3)
        assert sorted(pool.engines) == [0, 2] and not sup.refills and sup.sync_owed  # weights after this step
    finally:
        sup.close()
    reasons = [e.reason for e in sup.events]
    assert reasons == [
        "engine 1 died; 2 leased prompts requeued",
        "starting engine(s) [2] in its place; meanwhile the run goes on with 1 engine(s)",
        "started engine 2 (engine(s) replacing [1]); it generates after the next sync",
    ]
    assert "no engine is left" not in stream.getvalue()


def test_replacements_that_join_together_are_counted_one_by_one(tmp_path):
    pool = StartingPool([0, 1, 2])
    sup, _, _ = supervisor(tmp_path, pool, "generators.num_engines=3")
    try:
        sup.replace(0, [1, 2])
        sup.poll_refills(0)
    finally:
        sup.close()
    joined = [(e.engines_before, e.engines_after) for e in sup.events if e.reason.startswith("started engine")]
    assert joined == [(1, 2), (2, 3)] and sorted(pool.engines) == [0, 3, 4]


def test_a_background_start_that_fails_three_times_then_works_joins_and_is_counted(tmp_path):
    pool = StartingPool([0, 1], failures=3)
    sup, stream, _ = supervisor(tmp_path, pool, "generators.start_attempts=4")
    try:
        sup.replace(3, [1])
        looks = 0
        while sup.refills:
            sup.poll_refills(3)
            looks += 1
        assert looks == 7  # three times: fail, start again; then joined
    finally:
        sup.close()
    assert sorted(pool.engines) == [0, 5] and sup.failed_starts == 3 and sup.target == 2
    lines = stream.getvalue().splitlines()
    assert sum("failed (engine core killed while it initialized); starting again in 0s" in line for line in lines) == 3


def test_background_starts_all_spent_leave_the_run_going_on_with_the_survivors(tmp_path):
    pool = StartingPool([0, 1], failures=3)
    sup, _, _ = supervisor(tmp_path, pool)
    try:
        sup.replace(3, [1])
        while sup.refills:
            sup.poll_refills(3)
    finally:
        sup.close()
    assert list(pool.engines) == [0] and sup.target == 1 and sup.failed_starts == 3
    assert sup.events[-1].reason == (
        "engine(s) replacing [1]: 3 start(s) failed, the last with: engine core killed while it initialized; "
        "going on with 1 engine(s)"
    )


def test_with_no_engine_left_the_run_waits_for_a_replacement_and_says_so_once(tmp_path):
    pool = StartingPool([0, 1], failures=2)
    sup, stream, _ = supervisor(tmp_path, pool)
    try:
        sup.replace(4, [0, 1])  # returns once an engine joined
    finally:
        sup.close()
    assert pool.engines and sup.failed_starts == 2
    lines = stream.getvalue().splitlines()
    assert [line for line in lines if "no engine is left" in line] == [
        "[recovery] step 5: no engine is left to generate with; the run waits for 2 replacement(s) to start "
        "(up to 3 start(s) each)"
    ]


def test_with_no_engine_left_and_every_start_failed_the_run_stops_in_one_line(tmp_path):
    pool = StartingPool([0], failures=99)
    sup, _, _ = supervisor(tmp_path, pool, "generators.num_engines=1")
    try:
        with pytest.raises(RunError, match=r"^engine\(s\) replacing \[0\]: 3 start\(s\) failed, the last with: "
                                            r"engine core killed while it initialized; .*checkpoint"):
            sup.replace(0, [0])
    finally:
        sup.close()


def test_colocated_engines_start_while_the_loop_waits(tmp_path):
    pool = StartingPool([0, 1], failures=1)
    sup, stream, _ = supervisor(tmp_path, pool, "placement=colocated", "train.max_lag=0")
    try:
        sup.replace(2, [1])
    finally:
        sup.close()
    assert sorted(pool.engines) == [0, 2] and not sup.refills and sup.failed_starts == 1
    assert sup.events[-1].reason == "started engine(s) [2] in its place"
    assert "no engine is left" not in stream.getvalue()


def test_the_runs_end_waits_for_a_replacement_still_starting_and_syncs_it(tmp_path):
    pool = StartingPool([0, 1])
    sup, stream, synced = supervisor(tmp_path, pool)
    try:
        sup.replace(8, [0])
        sup.finish_refills(9, 10)
    finally:
        sup.close()
    assert sorted(pool.engines) == [1, 2] and synced == [10]
    assert "[recovery] step 10: waiting for 1 replacement engine(s) to start before the run ends" in stream.getvalue()


def test_a_resize_cancels_the_replacements_still_starting(tmp_path):
    pool = StartingPool([0, 1])
    sup, _, _ = supervisor(tmp_path, pool)
    try:
        sup.replace(1, [1])
        sup.resize(2, "operator", 1, "operator asked for 1 engine(s)")
    finally:
        sup.close()
    assert pool.cancelled == [2] and not sup.refills and list(pool.engines) == [0] and sup.target == 1
