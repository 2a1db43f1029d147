"""The supervisor acts on a death when Ray reports it, not at its next health check: it waits on the
ranks' step calls and on one pending `watch` call per buffer and engine together. Ray's wait and get
are stood in for by a script of what finishes when; the supervisor's bookkeeping is tested here."""

from __future__ import annotations

import io
import itertools
from types import SimpleNamespace

import pytest

from async_rl import supervisor as sup_module
from async_rl.config import load_config
from async_rl.errors import RunError
from async_rl.supervisor import Supervisor

_ids = itertools.count()


class Ref:
    def __init__(self, what: str, answer=None, error: BaseException | None = None) -> None:
        self.what, self.answer, self.error = what, answer, error


class Actor:
    """An actor handle: a distinct `_actor_id`, and `watch.remote()` handing out a Ref per call."""

    def __init__(self, name: str) -> None:
        self.name, self._actor_id, self.watch_calls = name, next(_ids), []
        self.watch = self

    def remote(self) -> Ref:
        ref = Ref(f"watch {self.name}")
        self.watch_calls.append(ref)
        return ref


class Runtime:
    def __init__(self) -> None:
        self.buffer = Actor("buffer0")
        self.generators = SimpleNamespace(engines={0: SimpleNamespace(actor=Actor("engine0"))}, stats=lambda: [])
        self.log: list[str] = []
        self.events: list = []  # the supervisor's
        self.step_refs = [Ref("rank0", answer="metrics0"), Ref("rank1", answer="metrics1")]

    def start_train_step(self, step: int) -> list[Ref]:
        return self.step_refs

    def restart_buffer(self) -> None:
        self.log.append(f"restart buffer, events logged: {len(self.events)}")
        self.buffer = Actor("buffer1")

    def ack_batch(self, step: int) -> int:
        self.log.append(f"ack {step}")
        return 0


def scripted(monkeypatch, script):
    """ray.wait returns, call after call, the ref `script` names among those it is given (the
    names of everything it waited on are recorded); ray.get answers or raises."""
    waited: list[list[str]] = []
    script = iter(script)

    def wait(refs, num_returns, timeout):
        waited.append(sorted(r.what for r in refs))
        name = next(script)
        done = [r for r in refs if r.what == name]
        assert len(done) == 1, (name, waited[-1])
        return done, [r for r in refs if r is not done[0]]

    def get(ref, timeout=None):
        if isinstance(ref, list):
            return [get(r) for r in ref]
        if ref.error is not None:
            raise ref.error
        return ref.answer

    monkeypatch.setattr(sup_module.ray, "wait", wait)
    monkeypatch.setattr(sup_module.ray, "get", get)
    return waited


@pytest.fixture
def setup(tmp_path):
    rt = Runtime()
    # no periodic check during these tests: only the notices act
    cfg = load_config(None, ["generators.health_check_s=100000"])
    sup = Supervisor(rt, cfg, tmp_path, "run", io.StringIO())
    rt.events = sup.events

    def replace(step, dead):
        rt.log.append(f"replace {dead}")
        rt.generators.engines = {1: SimpleNamespace(actor=Actor("engine1"))}

    sup.replace = replace
    sup.sync = lambda version, during_step=False: rt.log.append(f"sync {version} {during_step}")
    yield rt, sup
    sup.close()


def test_buffer_and_engine_deaths_are_acted_on_when_noticed(monkeypatch, setup):
    rt, sup = setup
    waited = scripted(monkeypatch, ["watch buffer0", "rank0", "watch engine0", "rank1"])
    assert sup.train_step(4) == ["metrics0", "metrics1"]
    # The buffer's death: logged (detection time) before the restart; the new buffer is watched,
    # the old one no longer. The engine's: replaced and synced at once, mid-step.
    assert rt.log == ["restart buffer, events logged: 1", "replace [0]", "sync 4 True", "ack 4"]
    assert [e.reason.split(";")[0] for e in sup.events] == ["buffer died"]
    assert waited[0] == ["rank0", "rank1", "watch buffer0", "watch engine0"]
    assert waited[1] == ["rank0", "rank1", "watch buffer1", "watch engine0"]
    assert waited[3] == ["rank1", "watch buffer1", "watch engine1"]  # its successor is watched
    assert len(rt.buffer.watch_calls) == 1  # armed once, not once per wait


def test_a_watch_of_a_process_already_replaced_is_ignored(monkeypatch, setup):
    rt, sup = setup
    old = rt.generators.engines[0].actor
    scripted(monkeypatch, ["rank0", "rank1"])
    sup._watchers()
    rt.generators.engines[0] = SimpleNamespace(actor=Actor("engine0-successor"))  # replaced elsewhere
    sup._watch_fired(4, old.watch_calls[0])
    assert rt.log == []


def test_a_dead_rank_stops_the_step_at_once(monkeypatch, setup):
    rt, sup = setup
    rt.step_refs[1].error = sup_module.ray.exceptions.ActorDiedError()
    scripted(monkeypatch, ["rank1"])
    with pytest.raises(RunError, match="learner rank 1 died"):
        sup.train_step(4)
