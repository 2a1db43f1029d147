"""A served replica (the teacher, the LLM judge) whose vLLM engine core hangs: its process lives, so it
is not dead, and its callers only see their calls time out and try again. The replica notices that
vLLM held requests `hang_s` without answering any, SIGKILLs the core and reports it, and the supervisor
then restarts it like a dead one (a dead or hung teacher is recovered)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from types import SimpleNamespace

import pytest

from async_rl.config import TeacherConfig
from async_rl.serving import model as served
from async_rl.serving import vllm_compat as vc
from async_rl.teacher.server import TeacherServer, TeacherSettings
from async_rl.teacher.setup import replica_engine_spec


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class Core:
    """vLLM's engine as `vc.score_tokens` sees it: a request answers when the test lets it."""

    errored = False

    def __init__(self) -> None:
        self.answers: asyncio.Queue = asyncio.Queue()


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(served, "time", SimpleNamespace(monotonic=c.monotonic))
    return c


@pytest.fixture
def core(monkeypatch) -> Core:
    async def score_tokens(llm: Core, token_ids: list[int], request_id: str, images=None, prompt_len: int = 0) -> list[float]:
        return await llm.answers.get()

    monkeypatch.setattr(vc, "score_tokens", score_tokens)
    return Core()


def spec() -> vc.EngineSpec:
    return replica_engine_spec(TeacherConfig(device="cpu"), "/nowhere", 64, 0)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_stalled_counts_from_the_last_answer_across_calls_given_up_on(clock, core):
    async def scenario() -> None:
        model = served.ServedModel(spec(), llm=core)
        assert model.stalled_s() == 0.0
        first = asyncio.create_task(model.score_tokens([1, 2], "a"))
        await _settle()
        clock.now += 50
        assert model.stalled_s() == 50  # held 50 s, nothing answered
        first.cancel()  # the caller's timeout: no answer
        await asyncio.gather(first, return_exceptions=True)
        assert model.stalled_s() == 0.0  # nothing held now
        clock.now += 1
        retry = asyncio.create_task(model.score_tokens([1, 2], "b"))
        await _settle()
        assert model.stalled_s() == 51  # the retry does not restart the clock
        core.answers.put_nowait([0.0, -1.0])
        assert await retry == [0.0, -1.0]
        assert model.stalled_s() == 0.0
        clock.now += 500
        slow = asyncio.create_task(model.score_tokens([1, 2], "c"))  # a new busy spell after an answer
        await _settle()
        clock.now += 5
        assert model.stalled_s() == 5
        core.answers.put_nowait([0.0, -2.0])
        await slow

    asyncio.run(scenario())


def test_a_hung_core_is_killed_and_the_replica_reports_it(monkeypatch, clock, core):
    for var in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS"):  # the replica sets them for its vLLM
        monkeypatch.setenv(var, "1")
    stopped = subprocess.Popen(["sleep", "600"])  # stands in for the core's process: stopped, alive
    try:
        stopped.send_signal(signal.SIGSTOP)
        monkeypatch.setattr(vc, "engine_core_pids", lambda llm: [stopped.pid])

        async def scenario() -> str:
            server = TeacherServer(TeacherSettings(replica_id=0, spec=spec(), model_name="t", key="k", threads=1,
                                                   hang_s=30.0))
            server.model = served.ServedModel(spec(), llm=core)
            call = asyncio.create_task(server.model.score_tokens([1, 2], "a"))
            await _settle()
            clock.now += 29
            watch = asyncio.create_task(server.watch())
            await asyncio.sleep(3 * vc.DEATH_POLL_S)
            assert not watch.done() and server.healthy()  # slow is not hung
            clock.now += 2
            why = await asyncio.wait_for(watch, 5.0)
            assert not server.healthy()
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
            return why

        why = asyncio.run(scenario())
        assert "answered no request for 31s (hung)" in why and str(stopped.pid) in why
        assert stopped.wait(timeout=10) == -signal.SIGKILL
    finally:
        if stopped.poll() is None:
            stopped.kill()
            stopped.wait()
