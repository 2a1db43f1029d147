"""A wedged reward pool is restarted within seconds: only the calls running on it are lost.

The wedge is made on purpose: the fork server is stopped (SIGSTOP) while a call times out. pebble then
SIGKILLs the worker and waits, holding the channel lock, for a death report the stopped server never
sends: without the runner's watchdog no call of that pool would ever resolve."""

from __future__ import annotations

import asyncio
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest

from async_rl.config import TaskConfig
from async_rl.generator import rewards
from async_rl.generator.rewards import RewardCounts, RewardRunner
from async_rl.protocol import REWARD_CRASH, REWARD_OK, REWARD_TIMEOUT, Prompt, Sample

REPO = Path(__file__).resolve().parents[2]
P = Prompt(prompt_id=3, text="c:", answer="c")
TIMEOUT_S = 0.5
MARGIN_S = 1.0  # the pool is restarted TIMEOUT_S + 3 s (pebble's SIGTERM grace) + MARGIN_S after its last progress


@pytest.fixture(autouse=True)
def repo_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))  # the rewards load by name from tests.unit


def sample(completion: str = "x", **metadata) -> Sample:
    return Sample(prompt=msgspec.structs.replace(P, metadata=metadata), completion=completion)


def runner_for(fn: str, workers: int = 1, restarts: list[str] | None = None) -> RewardRunner:
    """`restarts` collects the reasons the runner reports for its restarts."""
    return RewardRunner(
        TaskConfig(reward=f"tests.unit._rewards:{fn}"),
        timeout_s=TIMEOUT_S,
        workers=workers,
        stall_margin_s=MARGIN_S,
        on_restart=None if restarts is None else restarts.append,
    )


def gone(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    return not status.exists() or "zombie" in status.read_text()


async def wait_for_file(path: Path) -> int:
    for _ in range(400):
        if path.exists():
            return int(path.read_text())
        await asyncio.sleep(0.025)
    raise AssertionError(f"{path} never appeared")


def test_stopped_fork_server_the_pool_is_restarted_and_only_the_running_call_is_lost(tmp_path):
    restarts: list[str] = []
    runner = runner_for("wait", restarts=restarts)
    pid_file = tmp_path / "pid"

    async def main():
        assert await runner.score(sample()) == (1.0, REWARD_OK)  # the pool and its fork server run
        server = multiprocessing.forkserver._forkserver._forkserver_pid
        hung = asyncio.create_task(runner.score(sample("hang", pid_file=str(pid_file))))
        worker = await wait_for_file(pid_file)
        os.kill(server, signal.SIGSTOP)  # the server stops reaping: the timed-out worker's death goes unreported
        t0 = time.monotonic()
        queued = [asyncio.create_task(runner.score(sample(wait_s=0.05))) for _ in range(4)]
        await asyncio.sleep(TIMEOUT_S + 3.5)  # timed out, SIGTERMed, SIGKILLed: pebble now waits for good
        assert not runner.healthy() or runner.stalled_s() > 3.0  # calls wait and nothing resolves
        results = await asyncio.wait_for(asyncio.gather(hung, *queued), 30)
        recovered_s = time.monotonic() - t0
        after = await runner.score(sample())
        return server, worker, results, recovered_s, after

    try:
        server, worker, results, recovered_s, after = asyncio.run(main())
        assert results == [(0.0, REWARD_TIMEOUT)] + [(1.0, REWARD_OK)] * 4  # the queued calls ran on the new pool
        assert recovered_s < runner.stall_limit_s + 5.0
        assert after == (1.0, REWARD_OK)
        assert runner.pool_restarts == 1 and restarts == [f"no progress for {runner.stall_limit_s:g} s"]
        assert runner.counts == RewardCounts(ok=6, timeout=1)
        assert "no progress" in runner.last_error
        assert runner.healthy()
        assert gone(server) and gone(worker)  # killed, not left behind
        assert multiprocessing.forkserver._forkserver._forkserver_pid != server  # a new server serves the new pool
    finally:
        runner.close()


def test_worker_that_ignores_sigterm_is_killed_without_a_restart(tmp_path):
    # pebble's own path: SIGTERM, 3 s grace, SIGKILL. The runner must not mistake the grace for a wedge.
    runner = runner_for("ignores_sigterm", workers=2)
    pid_file = tmp_path / "pid"

    async def main():
        t0 = time.monotonic()
        hung = asyncio.create_task(runner.score(sample("hang", pid_file=str(pid_file))))
        worker = await wait_for_file(pid_file)
        others = await asyncio.gather(*(runner.score(sample(wait_s=0.05)) for _ in range(4)))
        return worker, await hung, others, time.monotonic() - t0

    try:
        worker, hung, others, took_s = asyncio.run(main())
        assert hung == (0.0, REWARD_TIMEOUT) and others == [(1.0, REWARD_OK)] * 4
        assert took_s < TIMEOUT_S + 3.0 + 2.0
        assert gone(worker)
        assert runner.pool_restarts == 0
    finally:
        runner.close()


def test_a_restart_that_fails_makes_the_runner_unhealthy(tmp_path, monkeypatch):
    runner = runner_for("wait")
    pid_file = tmp_path / "pid"

    def no_pool():
        raise OSError("no more processes")

    async def main():
        assert await runner.score(sample()) == (1.0, REWARD_OK)
        server = multiprocessing.forkserver._forkserver._forkserver_pid
        hung = asyncio.create_task(runner.score(sample("hang", pid_file=str(pid_file))))
        await wait_for_file(pid_file)
        os.kill(server, signal.SIGSTOP)
        monkeypatch.setattr(runner, "_new_pool", no_pool)
        return await asyncio.wait_for(hung, 30)

    try:
        assert asyncio.run(main()) == (0.0, REWARD_TIMEOUT)
        assert not runner.healthy()
        assert runner.failure == "the reward pool could not be restarted: OSError: no more processes"
        assert asyncio.run(runner.score(sample())) == (0.0, REWARD_CRASH)  # every later call tries again, fails
        assert runner.last_error == runner.failure
    finally:
        monkeypatch.undo()
        runner.close()


def test_close_of_a_wedged_pool_returns(tmp_path):
    runner = runner_for("wait")
    pid_file = tmp_path / "pid"

    async def main():
        assert await runner.score(sample()) == (1.0, REWARD_OK)
        server = multiprocessing.forkserver._forkserver._forkserver_pid
        hung = asyncio.create_task(runner.score(sample("hang", pid_file=str(pid_file))))
        await wait_for_file(pid_file)
        os.kill(server, signal.SIGSTOP)
        await asyncio.sleep(TIMEOUT_S + 3.5)  # pebble is stuck
        hung.cancel()
        return server

    server = asyncio.run(main())
    closer = threading.Thread(target=runner.close)
    t0 = time.monotonic()
    closer.start()
    closer.join(rewards.STOP_TIMEOUT_S + rewards.JOIN_TIMEOUT_S + 5)
    assert not closer.is_alive() and time.monotonic() - t0 < rewards.STOP_TIMEOUT_S + 5
    assert gone(server)


# A pool's owner started as a script, as an engine is (Ray's default_worker.py, which imports ray at its
# top). Its body appends the pid of every process that runs it to $MAIN_RAN.
SCRIPT_MAIN = """
import os
with open(os.environ["MAIN_RAN"], "a") as f:
    f.write(f"{os.getpid()}\\n")

if __name__ == "__main__":
    import asyncio
    import multiprocessing.forkserver

    import msgspec

    from async_rl.config import TaskConfig
    from async_rl.generator.rewards import RewardRunner
    from async_rl.protocol import Prompt, Sample

    runner = RewardRunner(TaskConfig(reward="tests.unit._rewards:pid"), timeout_s=30.0, workers=2)
    sample = Sample(prompt=Prompt(prompt_id=0, text="q", answer="a"), completion="x")

    async def main():
        return await asyncio.gather(*(runner.score(sample) for _ in range(6)))

    workers = sorted({int(value) for value, _ in asyncio.run(main())})
    print(msgspec.json.encode([os.getpid(), multiprocessing.forkserver._forkserver._forkserver_pid, workers]).decode())
    runner.close()
"""


def test_workers_of_a_script_started_owner_do_not_rerun_its_main(tmp_path):
    # multiprocessing re-runs a file main in every fork-server child that lacks it: in an engine, every
    # worker start (each replacement after a timeout or a crash) re-imported ray for ~1.5 s of CPU on the
    # engine's cores. The fork server runs it once; its workers must not.
    script, ran = tmp_path / "owner.py", tmp_path / "main_ran"
    script.write_text(SCRIPT_MAIN)
    env = {**os.environ, "MAIN_RAN": str(ran), "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    owner, server, workers = msgspec.json.decode(out.stdout.strip().splitlines()[-1])
    ran_in = [int(pid) for pid in ran.read_text().split()]
    assert workers and not set(workers) & set(ran_in), (workers, ran_in)
    assert sorted(ran_in) == sorted([owner, server])  # once in the owner, once in the fork server
