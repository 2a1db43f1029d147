"""Score samples in reward worker processes, so rewards cannot hurt each other or the engine.

Each engine keeps a `pebble.ProcessPool` of `task.reward_workers` processes. Every worker rebuilds
the reward function from the task config (names and strings; nothing live is pickled). A call's
timeout runs from the moment a worker starts it (pebble stamps it when the worker acknowledges the
call), never while it queues; a call past it has its worker killed and replaced. A worker that dies
(a crash, a signal) is replaced too. So a hung reward costs only its own sample: the others wait
for a free worker at most one timeout and are then scored in full.

Every outcome is counted per reason (`counts`) and carried on the wire as the sample's reward
status: REWARD_OK, REWARD_ERROR (raised, or not a finite number), REWARD_TIMEOUT, REWARD_CRASH."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import sys
from concurrent.futures.process import BrokenProcessPool

import msgspec
import pebble
from pebble.common.types import RemoteTraceback

from async_rl.config import TaskConfig
from async_rl.generator import reward_worker
from async_rl.protocol import REWARD_CRASH, REWARD_ERROR, REWARD_OK, REWARD_TIMEOUT, Sample

# Worker processes come from a fork server: started once per engine process, fresh (none of the
# engine's threads), with the reward's libraries imported before it forks. A replaced worker then
# starts in milliseconds instead of re-importing them (sympy alone takes about a second on 2 cores).
START_METHOD = "forkserver"


class RewardCounts(msgspec.Struct):
    """Reward calls of one runner by outcome."""

    ok: int = 0
    error: int = 0
    timeout: int = 0
    crash: int = 0


def _preload(task: TaskConfig) -> list[str]:
    """Modules the fork server imports once, so each worker starts with them loaded."""
    modules = [reward_worker.__name__]
    if task.reward == "math":
        modules.append("math_verify")
    elif ":" in task.reward:
        modules.append(task.reward.partition(":")[0])
    if not task.reward and task.name.startswith("reasoning_gym:"):
        modules.append("reasoning_gym")
    elif not task.reward and ":" in task.name:
        modules.append(task.name.partition(":")[0])
    return modules


def _context(task: TaskConfig) -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(_preload(task))  # no effect once this process's fork server runs
    return ctx


class RewardRunner:
    def __init__(self, task: TaskConfig, timeout_s: float, workers: int) -> None:
        self.task = task
        self.timeout_s = timeout_s
        self.workers = workers
        self.counts = RewardCounts()
        self.pools_replaced = 0  # pools found broken (e.g. every worker died while idle) and started anew
        self.last_error = ""  # why the last reward that was not REWARD_OK failed, for the user's eyes
        self._pool = self._new_pool()

    def _new_pool(self) -> pebble.ProcessPool:
        return pebble.ProcessPool(
            max_workers=self.workers,
            initializer=reward_worker.init_worker,
            initargs=(self.task, list(sys.path), os.getpid()),
            context=_context(self.task),
        )

    def _replace(self, broken: pebble.ProcessPool) -> None:
        if self._pool is broken:  # concurrent calls that all saw it broken replace it once
            broken.stop()
            self._pool = self._new_pool()
            self.pools_replaced += 1

    async def score(self, sample: Sample) -> tuple[float, int]:
        """(reward, status): status is REWARD_OK, or REWARD_ERROR, REWARD_TIMEOUT, REWARD_CRASH
        with reward 0."""
        value, status = await self._run(sample)
        if status == REWARD_OK:
            self.counts.ok += 1
        elif status == REWARD_TIMEOUT:
            self.counts.timeout += 1
        elif status == REWARD_CRASH:
            self.counts.crash += 1
        else:
            self.counts.error += 1
        return value, status

    async def _run(self, sample: Sample) -> tuple[float, int]:
        for _ in range(2):
            pool = self._pool
            try:
                future = pool.schedule(reward_worker.score, args=(sample,), timeout=self.timeout_s)
            except RuntimeError:  # the pool is broken: see below
                self._replace(pool)
                continue
            try:
                return await asyncio.wrap_future(future), REWARD_OK
            except TimeoutError:
                # pebble's own timeout carries no remote traceback; a TimeoutError the reward raised does
                # (asyncio re-creates TimeoutErrors without their cause: read the original).
                error = future.exception()
                if isinstance(error.__cause__, RemoteTraceback):
                    self.last_error = f"TimeoutError: {error}"
                    return 0.0, REWARD_ERROR
                self.last_error = f"timeout: running past {self.timeout_s} s"
                return 0.0, REWARD_TIMEOUT
            except pebble.ProcessExpired as exc:
                # its worker died mid-call (a crash, a signal); pebble starts another
                self.last_error = f"crash: the reward worker exited with code {exc.exitcode}"
                return 0.0, REWARD_CRASH
            except BrokenProcessPool:
                # pebble gives up its pool when a worker dies with no call running (killed while idle);
                # this call had not started: it runs again on a fresh pool.
                self._replace(pool)
            except Exception as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                return 0.0, REWARD_ERROR
        self.last_error = "crash: the reward pool broke twice"
        return 0.0, REWARD_CRASH

    def close(self) -> None:
        """Stop the workers now (a call still running is killed)."""
        self._pool.stop()
        self._pool.join()
