"""A call into vLLM's engine core that is in flight when the core dies fails at once, not never."""

from __future__ import annotations

import asyncio
import time

import pytest

from async_rl.serving import vllm_compat as vc


class CoreClient:
    """What vc.is_dead reads of an AsyncLLM: `errored`, set by vLLM's monitor when the core exits."""

    errored = False


def test_watched_call_fails_within_a_poll_of_the_core_dying():
    llm = CoreClient()

    async def scenario():
        never = asyncio.get_running_loop().create_future()  # vLLM 0.32 never answers such a call
        asyncio.get_running_loop().call_later(0.3, lambda: setattr(llm, "errored", True))
        t0 = time.monotonic()
        with pytest.raises(vc.EngineDied, match="receive_weights v3: vLLM's engine core died"):
            await vc.watched(llm, never, "receive_weights v3")
        assert never.cancelled()
        return time.monotonic() - t0

    assert asyncio.run(scenario()) < 0.3 + 2 * vc.DEATH_POLL_S


def test_watched_call_returns_its_answer_while_the_core_lives():
    async def scenario():
        return await vc.watched(CoreClient(), asyncio.sleep(0.3, result="done"), "pause")

    assert asyncio.run(scenario()) == "done"


def test_an_engine_core_that_exited_is_seen_at_once_without_vllms_flag():
    """core_watch looks at the core's process itself: a SIGKILLed core (a zombie until reaped) is dead
    at the next look, while vLLM's `errored` flag still says nothing."""
    import signal
    import subprocess
    import sys
    from types import SimpleNamespace

    from async_rl.serving import core_watch

    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    manager = SimpleNamespace(processes=[SimpleNamespace(pid=core.pid)])
    llm = CoreClient()
    llm.engine_core = SimpleNamespace(resources=SimpleNamespace(engine_manager=manager))
    try:
        assert core_watch.core_pids(llm) == [core.pid]
        assert core_watch.exited_core(llm) is None and not vc.is_dead(llm)
        core.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while core_watch.exited_core(llm) is None:  # the kernel delivers the signal asynchronously
            assert time.monotonic() < deadline, "a killed core still looks alive"
            time.sleep(0.01)
        assert core_watch.exited_core(llm) == core.pid and vc.is_dead(llm) and not llm.errored
        core.wait()  # reaped: gone, still dead
        assert vc.is_dead(llm)
    finally:
        core.kill()
        core.wait()
    # a vLLM that keeps its processes elsewhere: only its flag tells
    assert core_watch.core_pids(CoreClient()) == [] and not vc.is_dead(CoreClient())


def test_a_call_into_a_killed_core_says_how_it_ended():
    """The death line carries the core's exit code in words (vLLM keeps its cores as multiprocessing
    processes): a SIGKILL names the out-of-memory killer as the usual sender."""
    import multiprocessing
    import signal
    from types import SimpleNamespace

    from async_rl.serving import core_watch

    core = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    core.start()
    llm = CoreClient()
    llm.engine_core = SimpleNamespace(resources=SimpleNamespace(engine_manager=SimpleNamespace(processes=[core])))

    async def scenario():
        never = asyncio.get_running_loop().create_future()
        with pytest.raises(vc.EngineDied) as died:
            await vc.watched(llm, never, "join_weight_group")
        return str(died.value)

    try:
        assert core_watch.death_line(llm) == "vLLM's engine core died"  # alive: no code yet
        core.kill()
        line = asyncio.run(scenario())
    finally:
        core.kill()
        core.join()
    assert line == f"join_weight_group: vLLM's engine core died (killed by {signal.SIGKILL.name} (the out-of-memory killer, or a kill))"
