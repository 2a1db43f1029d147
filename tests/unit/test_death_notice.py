"""A death is acted on when it is known, wherever the loop is: the watcher (death_watch.py) keeps one
`watch` call pending on every process of the run and reports each death once, at once; the
supervisor logs it, aborts a weight sync in flight, and recovers at its next look (every WAKE_S in a
step, after each phase between steps). Ray's wait and get are stood in for by scripts here."""

from __future__ import annotations

import io
import itertools
import json
import shutil
import threading
import time
from types import SimpleNamespace

import msgspec
import pytest
import ray

from async_rl.buffer.ledger import Accounts
from async_rl.buffer.snapshot import BufferState
from async_rl.cluster.resources import actor_key
from async_rl.config import load_config
from async_rl.control import death_watch as dw_module
from async_rl.control import supervisor as sup_module
from async_rl.control.checkpoint import RunCheckpoint
from async_rl.control.death_watch import DeathNotice, DeathWatch, Target, Watched
from async_rl.control.recovery import LearnerRecovery
from async_rl.control.supervisor import LearnerRestarted, Supervisor
from async_rl.errors import RunError

_ids = itertools.count()


class Ref:
    def __init__(self, what: str, answer=None, error: BaseException | None = None) -> None:
        self.what, self.answer, self.error = what, answer, error


class ActorId:
    def __init__(self) -> None:
        self.n = next(_ids)

    def hex(self) -> str:
        return f"{self.n:08x}"


class Actor:
    """An actor handle: a distinct `_actor_id`, and `watch.remote()` handing out a Ref per call."""

    def __init__(self, name: str) -> None:
        self.name, self._actor_id, self.watch_calls = name, ActorId(), []
        self.watch = self

    def remote(self) -> Ref:
        ref = Ref(f"watch {self.name}")
        self.watch_calls.append(ref)
        return ref


def fake_ray(monkeypatch, module, finished: set[str]):
    """ray.wait returns the refs whose name is in `finished` (at most one, as with num_returns=1);
    ray.get answers or raises."""
    waited: list[list[str]] = []

    def wait(refs, num_returns=1, timeout=None, fetch_local=True):
        waited.append(sorted(r.what for r in refs))
        done = [r for r in refs if r.what in finished][:num_returns]
        return done, [r for r in refs if r not in done]

    def get(ref, timeout=None):
        if isinstance(ref, list):
            return [get(r) for r in ref]
        if ref.error is not None:
            raise ref.error
        return ref.answer

    monkeypatch.setattr(module.ray, "wait", wait)
    monkeypatch.setattr(module.ray, "get", get)
    return waited


# ---- the watcher ---------------------------------------------------------------------------------


def test_the_watcher_reports_each_death_once_and_never_a_process_taken_out_on_purpose(monkeypatch):
    buffer, e0, e1 = Actor("buffer"), Actor("e0"), Actor("e1")
    targets = {Watched("buffer", -1, actor_key(buffer)): Target(buffer), Watched("engine", 0, actor_key(e0)): Target(e0)}
    seen: list[DeathNotice] = []
    watch = DeathWatch(lambda: dict(targets), seen.append)
    finished: set[str] = set()
    waited = fake_ray(monkeypatch, dw_module, finished)

    assert watch.poll(0) == []
    assert waited[-1] == ["watch buffer", "watch e0"]
    targets[Watched("engine", 1, actor_key(e1))] = Target(e1)  # an engine joined: armed once, at the next look
    watch.poll(0)
    watch.poll(0)
    assert (len(buffer.watch_calls), len(e0.watch_calls), len(e1.watch_calls)) == (1, 1, 1)

    # engine 0's actor dies: Ray fails its watch call; reported once, with why, and not watched again
    e0.watch_calls[0].error = dw_module.ray.exceptions.ActorDiedError()
    finished.add("watch e0")
    [notice] = watch.poll(0)
    assert (notice.kind, notice.ident, notice.actor_id) == ("engine", 0, actor_key(e0))
    assert notice.why.startswith("its actor died")
    assert seen == [notice] and watch.take() == [notice] and watch.take() == []
    assert watch.poll(0) == [] and len(e0.watch_calls) == 1

    # engine 1 is drained: taken out of the run, then stopped; its watch ends, and that is no death
    del targets[Watched("engine", 1, actor_key(e1))]
    e1.watch_calls[0].error = dw_module.ray.exceptions.ActorDiedError()
    finished.add("watch e1")
    assert watch.poll(0) == [] and watch.take() == []

    # an engine whose vLLM core exited: its watch returns why
    e2 = Actor("e2")
    targets[Watched("engine", 2, actor_key(e2))] = Target(e2)
    watch.poll(0)
    e2.watch_calls[0].answer = "vLLM's engine core died"
    finished.add("watch e2")
    [notice] = watch.poll(0)
    assert (notice.ident, notice.why) == (2, "vLLM's engine core died")


def test_a_handle_map_changed_while_read_is_read_again(monkeypatch):
    calls = itertools.count()
    actor = Actor("buffer")

    def targets():
        if next(calls) == 0:
            raise RuntimeError("dictionary changed size during iteration")
        return {Watched("buffer", -1, actor_key(actor)): Target(actor)}

    fake_ray(monkeypatch, dw_module, set())
    DeathWatch(targets, lambda n: None).poll(0)
    assert len(actor.watch_calls) == 1


# ---- the supervisor acting on notices ----------------------------------------------------------


class Runtime:
    def __init__(self) -> None:
        self.buffer = Actor("buffer0")
        self.aborted: list[str] = []
        self.abort_done = threading.Event()
        self.generators = SimpleNamespace(
            engines={0: SimpleNamespace(actor=Actor("engine0"), started=True)}, stats=lambda: [], abort_sync=self._abort
        )
        self.learner = SimpleNamespace(actors=[Actor("rank0"), Actor("rank1")])
        self.reward_models = None
        self.log: list[str] = []
        self.step_refs = [Ref("rank0", answer="metrics0"), Ref("rank1", answer="metrics1")]
        self.dead_rank: int | None = None  # what dead_learner_rank finds
        self.targets_while_restarting: dict = {}
        self.restart_failures: list[BaseException] = []  # what the next restarts of the learner group raise
        self.supervisor: Supervisor | None = None  # set by the fixture: what restart_learner looks at

    def dead_learner_rank(self) -> int | None:
        return self.dead_rank

    def served_pools(self) -> dict:
        return {}  # no reward model, no teacher

    def _abort(self, member: int, reason: str, actor_id: str | None) -> None:
        self.aborted.append(f"{member}: {reason} ({actor_id})")
        self.abort_done.set()

    def start_train_step(self, step: int) -> list[Ref]:
        return self.step_refs

    def restart_buffer(self) -> None:
        self.log.append("restart buffer")
        self.buffer = Actor("buffer1")

    def ack_batch(self, step: int) -> int:
        self.log.append(f"ack {step}")
        return 0

    def restart_learner(self, checkpoint_dir: str | None, from_step: int) -> None:
        self.log.append(f"restart learner from {checkpoint_dir} at step {from_step}")
        self.learner = SimpleNamespace(actors=[Actor("rank0 again"), Actor("rank1 again")])
        if self.restart_failures:  # a rank of the new group dies (or hangs) while it starts
            raise self.restart_failures.pop(0)
        if self.supervisor is not None:  # what the watcher reads while the new ranks start
            self.targets_while_restarting = self.supervisor._targets()


@pytest.fixture
def setup(tmp_path):
    rt = Runtime()
    # no periodic check during these tests: only the notices act
    cfg = load_config(None, ["generators.health_check_s=100000"])
    sup = Supervisor(rt, cfg, tmp_path, "run", io.StringIO())
    rt.supervisor = sup

    def replace(step, dead):
        rt.log.append(f"replace {dead} at step {step}")
        rt.generators.engines = {1: SimpleNamespace(actor=Actor("engine1"))}

    sup.replace = replace
    sup.sync = lambda version, during_step=False: rt.log.append(f"sync {version} {during_step}")
    yield rt, sup
    sup.close()


def notice(kind: str, ident: int, actor: Actor, why: str = "its actor died") -> DeathNotice:
    return DeathNotice(kind, ident, actor_key(actor), why, 0.0)


def deliver(sup: Supervisor, n: DeathNotice) -> None:
    """What the watcher thread does with a death it found."""
    sup.deaths.report(n)


def test_a_death_is_logged_at_once_and_a_sync_in_flight_aborted(setup, tmp_path):
    rt, sup = setup
    deliver(sup, notice("engine", 0, rt.generators.engines[0].actor, "vLLM's engine core died"))
    deliver(sup, notice("buffer", -1, rt.buffer))
    logged = [json.loads(line) for line in (tmp_path / "scaling.jsonl").read_text().splitlines()]
    assert [(e["source"], e["reason"]) for e in logged] == [
        ("watch", "engine 0 found dead: vLLM's engine core died"),
        ("watch", "buffer found dead: its actor died"),
    ]
    assert rt.abort_done.wait(10)  # the abort runs on a thread of its own
    # only a member of the weight group aborts a sync, and only the instance found dead
    assert rt.aborted == [f"0: engine 0 found dead ({actor_key(rt.generators.engines[0].actor)})"]
    assert rt.log == []  # acting is the loop's job, at its next look


def test_notices_are_acted_on_between_steps_and_stale_ones_dropped(setup):
    rt, sup = setup
    old_engine = rt.generators.engines[0].actor
    deliver(sup, notice("buffer", -1, rt.buffer))
    deliver(sup, notice("engine", 0, old_engine))
    sup.act_on_deaths(4, 5)
    assert rt.log == ["restart buffer", "replace [0] at step 4", "sync 5 False"]
    # the same process reported again (a second path) or one replaced meanwhile: nothing to do
    deliver(sup, notice("engine", 0, old_engine))
    deliver(sup, notice("buffer", -1, Actor("an old buffer")))
    sup.act_on_deaths(5, 6)
    assert rt.log == ["restart buffer", "replace [0] at step 4", "sync 5 False"]


def test_a_dead_learner_rank_between_steps_restarts_the_group_from_the_newest_checkpoint(setup, tmp_path):
    rt, sup = setup
    ckpt = tmp_path / "checkpoints" / "step_2"
    ckpt.mkdir(parents=True)
    (ckpt / "run_state.json").write_bytes(msgspec.json.encode(
        RunCheckpoint(step=2, version=2, saved_at=0.0, buffer=BufferState(accounts=Accounts(), generator_version=2, prompts_drawn=0,
                                                            rejected_frames={}, reward_errors=0, reward_timeouts=0))
    ))
    # a newer checkpoint cut short by the death (its run state written, never renamed into place)
    cut = tmp_path / "checkpoints" / ".tmp-0badc0de"
    shutil.copytree(ckpt, cut)
    deliver(sup, notice("learner", 1, rt.learner.actors[1]))
    with pytest.raises(LearnerRestarted) as info:
        sup.act_on_deaths(3, 4)
    assert (info.value.step, info.value.recoveries) == (2, 1)
    assert rt.log == [f"restart learner from {ckpt} at step 2", "sync 2 False"]
    assert not cut.exists()  # removed once the old group is gone, in one line
    assert "[recovery] learner group restarted: removed 1 checkpoint(s) cut short: .tmp-0badc0de\n" in sup.stream.getvalue()
    assert "[recovery] the learning of 1 step(s) was lost with the group and is trained again from step 2\n" in sup.stream.getvalue()
    recovery = [json.loads(line) for line in (tmp_path / "scaling.jsonl").read_text().splitlines()][-1]
    assert recovery["source"] == "recovery"
    assert recovery["reason"] == f"learner rank 1 died (its actor died); restarting the learner group from {ckpt} (step 2, recovery 1)"
    # the old group's ranks are no longer the run's: their late notices are dropped
    deliver(sup, notice("learner", 0, Actor("rank0")))
    sup.act_on_deaths(3, 3)
    assert len(rt.log) == 2


def test_a_dead_learner_rank_before_any_checkpoint_says_its_learning_is_lost(setup, tmp_path):
    rt, sup = setup
    deliver(sup, notice("learner", 0, rt.learner.actors[0]))
    with pytest.raises(LearnerRestarted) as info:
        sup.act_on_deaths(6, 7)
    assert (info.value.step, info.value.recoveries) == (0, 1)
    assert rt.log == ["restart learner from None at step 0", "sync 0 False"]
    assert ("[recovery] the learning of 6 step(s) was lost with the group and is trained again from step 0; "
            "no checkpoint yet: train.checkpoint_every bounds this\n") in sup.stream.getvalue()


def test_with_recover_off_a_dead_learner_rank_stops_the_run_with_one_line(setup):
    rt, sup = setup
    sup.recovery = LearnerRecovery("off", 3, 100)
    deliver(sup, notice("learner", 1, rt.learner.actors[1]))
    with pytest.raises(RunError, match=r"^learner rank 1 died \(its actor died\); no checkpoint was written, .* is off\)$"):
        sup.act_on_deaths(2, 3)
    assert rt.log == []


def test_a_rank_that_dies_while_the_group_restarts_is_another_recovery_within_the_bound(setup):
    rt, sup = setup
    rt.restart_failures = [ray.exceptions.ActorDiedError(), ray.exceptions.GetTimeoutError("Get timed out")]
    deliver(sup, notice("learner", 1, rt.learner.actors[1]))
    with pytest.raises(LearnerRestarted) as info:
        sup.act_on_deaths(3, 4)
    # the first death, then a rank of each new group: three recoveries, the third group up and synced
    assert (info.value.step, info.value.recoveries) == (0, 3)
    assert rt.log == ["restart learner from None at step 0"] * 3 + ["sync 0 False"]
    reasons = [json.loads(line)["reason"] for line in (sup.run_dir / "scaling.jsonl").read_text().splitlines()]
    assert reasons[-2:] == [
        "a rank of the restarting learner group failed (The actor died unexpectedly before finishing this task.); "
        "restarting the learner group again from the initial weights (step 0, recovery 2)",
        "a rank of the restarting learner group failed (Get timed out); restarting the learner group again from "
        "the initial weights (step 0, recovery 3)",
    ]


def test_a_rank_that_dies_while_the_group_restarts_past_the_bound_stops_the_run_in_one_line(setup):
    rt, sup = setup
    sup.recovery = LearnerRecovery("auto", 1, 0)
    rt.restart_failures = [ray.exceptions.ActorDiedError()]
    deliver(sup, notice("learner", 0, rt.learner.actors[0]))
    with pytest.raises(RunError, match=r"^a rank of the restarting learner group failed \(The actor died unexpectedly "
                       r"before finishing this task\.\); 1 learner recoveries within the run already "
                       r"\(train.max_recoveries 1\); no checkpoint was written, the run cannot resume$"):
        sup.act_on_deaths(2, 3)
    assert rt.log == ["restart learner from None at step 0"]


def test_a_death_during_a_step_is_acted_on_before_the_step_returns(monkeypatch, setup):
    rt, sup = setup
    finished: set[str] = set()
    looks = itertools.count()

    def wait(refs, num_returns=1, timeout=None):
        # the first look: nothing finished, and meanwhile the watcher reports the engine's death
        if next(looks) == 0:
            deliver(sup, notice("engine", 0, rt.generators.engines[0].actor))
            finished.update({"rank0", "rank1"})
            return [], list(refs)
        done = [r for r in refs if r.what in finished][:1]
        return done, [r for r in refs if r not in done]

    monkeypatch.setattr(sup_module.ray, "wait", wait)
    monkeypatch.setattr(sup_module.ray, "get", lambda ref, timeout=None: [r.answer for r in ref] if isinstance(ref, list) else ref.answer)
    assert sup.train_step(4) == ["metrics0", "metrics1"]
    # replaced and synced mid-step (the learner serves the sync while it waits), then the ack
    assert rt.log == ["replace [0] at step 4", "sync 4 True", "ack 4"]


def test_a_dead_rank_restarts_the_group_at_once(monkeypatch, setup):
    rt, sup = setup
    rt.step_refs[1].error = sup_module.ray.exceptions.ActorDiedError()
    fake_ray(monkeypatch, sup_module, {"rank1"})
    with pytest.raises(LearnerRestarted) as info:
        sup.train_step(4)
    assert info.value.step == 0  # no checkpoint yet: the initial weights, step 0
    assert rt.log == ["restart learner from None at step 0", "sync 0 False"]  # no ack of the step


def test_a_rank_found_dead_during_a_checkpoint_restarts_the_group_instead_of_waiting(monkeypatch, setup):
    """The survivor of a checkpoint's collective never answers: the watcher's notice ends the wait."""
    rt, sup = setup
    waited = fake_ray(monkeypatch, sup_module, set())  # neither rank's save finishes
    deliver(sup, notice("learner", 0, rt.learner.actors[0]))
    with pytest.raises(LearnerRestarted):
        sup.on_learner(3, [Ref("save0"), Ref("save1")])
    assert waited == [] and rt.log == ["restart learner from None at step 0", "sync 0 False"]


def test_a_call_on_every_rank_returns_their_answers_in_rank_order(monkeypatch, setup):
    rt, sup = setup
    fake_ray(monkeypatch, sup_module, {"probe0", "probe1"})
    assert sup.on_learner(3, [Ref("probe0", answer="p0"), Ref("probe1", answer="p1")]) == ["p0", "p1"]
    rt.learner.actors = [Actor("rank0")]
    fake_ray(monkeypatch, sup_module, {"save0"})
    with pytest.raises(LearnerRestarted):  # its call failed: the rank died in it
        sup.on_learner(3, [Ref("save0", error=sup_module.ray.exceptions.ActorDiedError())])


# ---- hangs ---------------------------------------------------------------------------------------


class Probed(Actor):
    """An actor whose liveness probes (`__ray_ready__`) are Refs named 'probe NAME'."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.probes: list[Ref] = []
        self.__ray_ready__ = SimpleNamespace(remote=self._probe)

    def _probe(self) -> Ref:
        ref = Ref(f"probe {self.name}", answer=True)
        self.probes.append(ref)
        return ref


def test_a_process_that_answers_no_probe_for_unresponsive_s_is_reported_dead_once(monkeypatch):
    """A stopped process keeps its watch pending forever: its unanswered liveness probe reports it."""
    clock = [1000.0]
    monkeypatch.setattr(dw_module.time, "monotonic", lambda: clock[0])
    busy, stopped, starting = Probed("busy"), Probed("stopped"), Probed("starting")
    targets = {
        Watched("engine", 0, actor_key(busy)): Target(busy),
        Watched("learner", 1, actor_key(stopped)): Target(stopped),
        Watched("engine", 2, actor_key(starting)): Target(starting, probe=False),  # vLLM still starting
    }
    watch = DeathWatch(lambda: dict(targets), lambda n: None, unresponsive_s=10.0)
    answered: set[str] = set()

    def wait(refs, num_returns=1, timeout=None, fetch_local=True):
        done = [r for r in refs if r.what in answered][: max(num_returns, 0) or len(refs)]
        return done, [r for r in refs if r not in done]

    monkeypatch.setattr(dw_module.ray, "wait", wait)
    answered.add("probe busy")  # 'busy' answers every probe; 'stopped' none
    for _ in range(9):  # 9 s of looks, one a second: a probe each to both, none reported yet
        assert watch.poll(0) == []
        clock[0] += 1.0
    assert len(stopped.probes) == 1 and len(busy.probes) >= 4  # one probe in flight at a time
    clock[0] += 1.5
    [notice] = watch.poll(0)
    assert (notice.kind, notice.ident) == ("learner", 1)
    assert notice.why.startswith("no answer to a liveness probe for 10s")
    clock[0] += 30.0
    assert watch.poll(0) == []  # reported once; the busy one never
    assert starting.probes == []  # an engine still starting is not probed (its start may hold its loop)


def test_the_step_time_limit_follows_the_slowest_recent_step_within_floor_and_ceiling():
    assert sup_module.step_limit([], 1800.0) == 1800.0  # nothing measured yet: the ceiling
    assert sup_module.step_limit([2.0, 3.0], 1800.0) == sup_module.STEP_FLOOR_S
    assert sup_module.step_limit([2.0, 100.0], 1800.0) == 500.0
    assert sup_module.step_limit([2.0, 1000.0], 1800.0) == 1800.0
    assert sup_module.step_limit([2.0], 0.0) is None  # 0: no limit


def test_a_step_past_its_limit_is_a_hang_named_in_one_line(monkeypatch, setup):
    rt, sup = setup
    clock = [0.0]
    monkeypatch.setattr(sup_module.time, "monotonic", lambda: clock[0])

    def wait(refs, num_returns=1, timeout=None):  # rank 0 finishes, rank 1 never does
        clock[0] += 1.0
        done = [r for r in refs if r.what == "rank0"]
        return done, [r for r in refs if r not in done]

    monkeypatch.setattr(sup_module.ray, "wait", wait)
    monkeypatch.setattr(sup_module.ray, "get", lambda ref, timeout=None: ref.answer)
    sup.cfg = load_config(None, ["generators.health_check_s=100000", "train.step_timeout_s=30"])
    sup.recovery = LearnerRecovery("off", 3, 100)  # the line itself (with recover auto the group restarts)
    with pytest.raises(RunError) as info:
        sup.train_step(4)
    line = str(info.value)
    assert "\n" not in line and line.startswith("learner rank(s) 1 hung: step 5 still running after 30s")
    assert clock[0] <= 32.0  # found at the first look past the limit


def test_a_sync_waiting_on_a_member_found_dead_gives_up_at_once(monkeypatch):
    """A stopped engine never answers its pause: the sync's wait gives up once the watcher marked it,
    and waits again normally once that engine left the pool."""
    from async_rl.generator import pool as pool_module

    pool = pool_module.GeneratorPool.__new__(pool_module.GeneratorPool)  # only the wait's state
    pool._group, pool._abandoned, pool.membership_stale, pool._members = None, {}, False, threading.Lock()
    pool.engines = {0: SimpleNamespace(actor=Actor("engine0"), pool=None)}
    looks = itertools.count()

    def wait(refs, num_returns=1, timeout=None):
        assert timeout <= pool_module.GATHER_LOOK_S
        if next(looks) == 2:  # the watcher's thread, meanwhile
            pool.abort_sync(0, "engine 0 found dead: no answer to a liveness probe for 8s")
        return [], list(refs)

    monkeypatch.setattr(pool_module.ray, "wait", wait)
    with pytest.raises(RunError, match="pausing: abandoned: engine 0 found dead: no answer"):
        pool._gather([Ref("pause engine0")], 600.0, "pausing")
    assert pool.membership_stale
    monkeypatch.setattr(pool_module.ray, "kill", lambda actor, no_restart: None)
    monkeypatch.setattr(pool_module.ray, "get", lambda ref, timeout=None: 3)
    pool.buffer = SimpleNamespace(requeue=SimpleNamespace(remote=lambda eid: Ref("requeue")))
    assert pool.drop_dead(0) == 3 and pool._abandoned == {}


def test_a_death_notice_acted_on_before_its_abandon_lands_leaves_no_abandoned_member(monkeypatch):
    """The watcher queues its notice, then abandons the engine on a thread of its own; the loop can
    take the notice and replace the engine before that thread runs. The late abandon must not stick
    to the gone engine: every later sync would give up on it (\"pausing: abandoned\") and find nothing
    to replace, which stopped a run (test_faults, 2026-11-26 22:28). Nor may it abort the group its
    successor joined."""
    from async_rl.generator import pool as pool_module

    aborted: list[str] = []
    monkeypatch.setattr(pool_module, "abort_membership", lambda group, reason: aborted.append(reason))
    monkeypatch.setattr(pool_module.ray, "kill", lambda actor, no_restart: None)
    monkeypatch.setattr(pool_module.ray, "get", lambda ref, timeout=None: 0)
    pool = pool_module.GeneratorPool.__new__(pool_module.GeneratorPool)  # only the membership's state
    pool._group, pool._abandoned, pool.membership_stale, pool._members = "group", {}, False, threading.Lock()
    pool.buffer = SimpleNamespace(requeue=SimpleNamespace(remote=lambda eid: Ref("requeue")))
    dead, successor = Actor("engine1"), Actor("engine2")
    pool.engines = {1: SimpleNamespace(actor=dead, pool=None), 2: SimpleNamespace(actor=successor, pool=None)}
    pool.drop_dead(1)  # the loop acted on the notice first
    pool.abort_sync(1, "engine 1 found dead", actor_key(dead))  # the watcher's thread, late
    assert pool._abandoned == {} and pool.abandoned_engines() == [] and aborted == []
    # an engine of the pool: abandoned, and the group in flight aborted
    pool.abort_sync(2, "engine 2 found dead", actor_key(successor))
    assert pool.abandoned_engines() == [2] and aborted == ["engine 2 found dead"]
    # a notice about another instance under the same id (already replaced) is stale too
    pool._abandoned.clear()
    pool.abort_sync(2, "engine 2 found dead", "0000dead")
    assert pool.abandoned_engines() == []

    def wait(refs, num_returns=1, timeout=None):  # the pause answers after a slow look
        done = [r for r in refs if wait.looks > 0]
        wait.looks += 1
        return done, [r for r in refs if r not in done]

    wait.looks = 0
    monkeypatch.setattr(pool_module.ray, "wait", wait)
    assert pool._gather([Ref("pause engine2")], 600.0, "pausing") == 0  # a slow answer is waited for


def test_every_process_of_the_run_is_a_target_and_a_starting_engine_is_not_probed(setup):
    rt, sup = setup
    rt.generators.engines[1] = SimpleNamespace(actor=Actor("engine1"), started=False)
    targets = sup._targets()
    assert sorted((w.kind, w.ident, t.probe) for w, t in targets.items()) == [
        ("buffer", -1, True), ("engine", 0, True), ("engine", 1, False), ("learner", 0, True), ("learner", 1, True),
    ]


def test_a_survivor_whose_collective_broke_restarts_the_group_for_its_dead_peer(monkeypatch, setup):
    """Rank 0's checkpoint save raised (gloo: connection reset by its dead peer) before Ray reported
    rank 1 dead: the dead peer is looked for and its group restarted, not the run stopped."""
    rt, sup = setup
    broken = sup_module.ray.exceptions.RayTaskError("save_checkpoint", "Connection reset by peer", RuntimeError("reset"))
    fake_ray(monkeypatch, sup_module, {"save0"})
    rt.dead_rank = 1
    with pytest.raises(LearnerRestarted):
        sup.on_learner(3, [Ref("save0", error=broken), Ref("save1")])
    assert rt.log == ["restart learner from None at step 0", "sync 0 False"]
    recovery = [json.loads(line) for line in (sup.run_dir / "scaling.jsonl").read_text().splitlines()][-1]
    assert recovery["reason"].startswith("learner rank 1 died (its actor died; rank 0's call failed with it)")
    # with no rank dead, a rank's error is the run's own
    rt.dead_rank = None
    with pytest.raises(sup_module.ray.exceptions.RayTaskError):
        sup.on_learner(3, [Ref("save0", error=broken), Ref("save1")])


def test_a_restarting_learner_group_is_watched_but_not_probed(setup):
    """Fresh ranks answer no liveness probe while their actors are constructed (seconds under load,
    more than generators.unresponsive_s): probing them then found a healthy new group 'hung'."""
    rt, sup = setup
    deliver(sup, notice("learner", 1, rt.learner.actors[1]))
    with pytest.raises(LearnerRestarted):
        sup.act_on_deaths(3, 4)
    learner = {w: t for w, t in rt.targets_while_restarting.items() if w.kind == "learner"}
    assert len(learner) == 2 and not any(t.probe for t in learner.values())
    assert all(t.probe for w, t in sup._targets().items() if w.kind == "learner")  # probed again once started


def test_a_failed_sync_raises_before_its_abort_reaches_a_store_gone_with_the_sender(monkeypatch):
    """Learner rank 0 hosts the weight group's store: killed mid-sync, its store takes the connect
    timeout to give up, which held the learner's recovery back 5-7 s (test_faults, 2026-11-27)."""
    from async_rl.generator import pool as pool_module

    reached, let_go, done = [], threading.Event(), threading.Event()

    def slow_abort(group, reason):
        let_go.wait(10)
        reached.append(reason)
        done.set()

    monkeypatch.setattr(pool_module, "abort_membership", slow_abort)
    monkeypatch.setattr(pool_module.ray, "wait", lambda refs, num_returns=1, timeout=None: (list(refs)[:1], list(refs)[1:]))
    monkeypatch.setattr(pool_module.ray, "get", lambda ref, timeout=None: (_ for _ in ()).throw(ref.error))
    pool = pool_module.GeneratorPool.__new__(pool_module.GeneratorPool)
    pool._group, pool._abandoned, pool.membership_stale, pool._members = "group", {}, False, threading.Lock()
    sender_died = pool_module.ray.exceptions.ActorDiedError()
    with pytest.raises(pool_module.ray.exceptions.ActorDiedError):
        pool._gather([Ref("broadcast v4", error=sender_died)], 600.0, "weight update v4")
    assert pool.membership_stale and reached == []  # raised while the abort still waits
    let_go.set()
    assert done.wait(10) and reached == ["weight update v4: ActorDiedError"]  # and the abort still goes out


def _sync_failing_once(rt: Runtime) -> list[int]:
    """The runtime's sync: the first attempt fails as a sync broken by a dead peer does; later ones succeed."""
    attempts: list[int] = []

    def sync_weights(version: int, during_step: bool = False) -> bool:
        attempts.append(version)
        if len(attempts) == 1:
            raise RunError(f"weight update v{version} failed: SyncAborted: Connection reset by peer")
        return True

    rt.sync_weights = sync_weights
    rt.tell_buffer_version = lambda: None
    rt.generators.find_dead = lambda: []  # the health check has not seen the death yet
    rt.generators.abandoned_engines = lambda: []
    return attempts


def test_a_sync_broken_by_a_death_found_a_moment_later_replaces_the_engine(setup):
    rt, sup = setup
    del sup.sync  # the real one, not the fixture's stand-in
    attempts = _sync_failing_once(rt)
    engine0 = rt.generators.engines[0].actor
    threading.Timer(0.6, deliver, (sup, notice("engine", 0, engine0, "vLLM's engine core died"))).start()
    t0 = time.monotonic()
    sup.sync(3)
    waited = time.monotonic() - t0
    assert attempts == [3, 3] and "replace [0] at step 2" in rt.log
    assert 0.6 <= waited < sup_module.SYNC_DEATH_GRACE_S


def test_a_sync_that_fails_with_every_member_alive_stops_after_the_grace(setup, monkeypatch):
    rt, sup = setup
    del sup.sync
    monkeypatch.setattr(sup_module, "SYNC_DEATH_GRACE_S", 0.5)
    _sync_failing_once(rt)
    t0 = time.monotonic()
    with pytest.raises(RunError, match="weight update v3 failed"):
        sup.sync(3)
    assert time.monotonic() - t0 >= 0.5 and not any(line.startswith("replace") for line in rt.log)

