"""Score samples in reward worker processes, so rewards cannot hurt each other or the engine.

Each engine keeps a `pebble.ProcessPool` of `task.reward_workers` processes. Every worker rebuilds
the reward function from the task config (names and strings; nothing live is pickled). A call's
timeout runs from the moment a worker starts it (pebble stamps it when the worker acknowledges the
call), never while it queues; a call past it has its worker killed and replaced. A worker that dies
(a crash, a signal) is replaced too. So a hung reward costs only its own sample: the others wait
for a free worker at most one timeout and are then scored in full.

Every outcome is counted per reason (`counts`) and carried on the wire as the sample's reward
status: REWARD_OK, REWARD_ERROR (raised, or not a finite number), REWARD_TIMEOUT, REWARD_CRASH.

A wedged pool is restarted. pebble enforces every timeout from one thread, which SIGKILLs a timed-out
worker and then join()s it without a timeout while it holds the channel lock; a fork-server worker's
death is reported only once the fork server reaps it. A fork server that stops reaping (stopped,
spinning) therefore freezes every timeout and every result of the pool. So the runner watches for
progress: calls waiting and none resolved for `stall_limit_s` (the call timeout, pebble's SIGTERM grace
and a margin for worker start-up) means the pool is wedged. Its processes (the fork server and every
worker) are SIGKILLed, which unblocks pebble (a dead server reads as exit code 255), the pool is
stopped and joined with a timeout, and a new one is started, all on a helper thread, never on the
caller's event loop. Calls that were running are lost (REWARD_TIMEOUT, counted); calls still queued
run on the new pool. `pool_restarts` counts rebuilt pools (wedged, or broken by pebble itself)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import msgspec
import pebble
from pebble.common import CONSTS
from pebble.common.types import RemoteTraceback

from async_rl.config import CLASSIFIER_PREFIX, JUDGE_PREFIX, TaskConfig
from async_rl.generator import reward_main, reward_worker
from async_rl.protocol import REWARD_CRASH, REWARD_ERROR, REWARD_OK, REWARD_TIMEOUT, Sample
from async_rl.reward_models.calls import OK, RewardModelCounts, RewardModelTimeout
from async_rl.reward_models.server import RewardEndpoint

# Worker processes come from a fork server: started once per engine process, fresh (none of the
# engine's threads), with the reward's libraries imported before it forks. A replaced worker then
# starts in milliseconds instead of re-importing them (sympy alone takes about a second on 2 cores),
# and without re-running the engine's main script, which multiprocessing would do in each worker
# (reward_main.py: Ray's default_worker.py imports ray, ~1.5 s of CPU per worker start).
# The fork server is a shared point of failure (see the module doc); `spawn` would remove it (each
# worker a direct child, its death seen by waitpid) at 1-3 s per started worker, paid at every timeout
# and crash and by every engine start (16 workers on 2 cores: ~20 s of imports). We keep the fork
# server and recover from its failure instead: the watchdog below restarts a wedged pool, server
# included, in about a second, and it also covers wedges spawn would not (a worker killed while it
# holds the channel lock, which no timeout then can take).
START_METHOD = "forkserver"
# What a wedged pool may take beyond the call timeout and pebble's SIGTERM grace before it is
# restarted: room for a replacement worker to start and run its initializer under load.
STALL_MARGIN_S = 10.0
# Stopping a wedged pool after its processes were killed takes well under a second; past this the
# pool is abandoned (its threads are daemons) and the engine reports itself unhealthy.
JOIN_TIMEOUT_S = 10.0
# A healthy pool stops within pebble's SIGTERM grace (a worker that ignores SIGTERM is SIGKILLed after
# it); one that takes longer is stuck and has its processes killed.
STOP_TIMEOUT_S = CONSTS.term_timeout + 1.0
# A reward that raised is logged with its sample (one line each) this many times per engine; later
# ones are counted only (a reward function broken for every sample would flood the log).
LOGGED_ERRORS = 20
SHOWN_CHARS = 200  # of the prompt and the completion text in such a line


class PoolWedged(Exception):
    """The pool a call waited on made no progress for stall_limit_s, or was replaced meanwhile."""


class RewardCounts(msgspec.Struct):
    """Reward calls of one runner by outcome."""

    ok: int = 0
    error: int = 0
    timeout: int = 0
    crash: int = 0


def _preload(task: TaskConfig) -> list[str]:
    """Modules the fork server imports once, so each worker starts with them loaded (reward_main: the
    engine's main script, which multiprocessing would otherwise re-run in every worker)."""
    modules = [reward_main.__name__, reward_worker.__name__]
    if task.reward == "math":
        modules.append("math_verify")
    elif task.reward.startswith((JUDGE_PREFIX, CLASSIFIER_PREFIX)):
        modules.extend(["async_rl.reward_models.calls", "openai", "httpx"])
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
        main_path = reward_main.main_script_path()
        if main_path is not None:
            os.environ[reward_main.MAIN_PATH_ENV] = main_path  # the fork server inherits it when it starts
        ctx.set_forkserver_preload(_preload(task))  # no effect once this process's fork server runs
    return ctx


class RewardRunner:
    def __init__(
        self,
        task: TaskConfig,
        timeout_s: float,
        workers: int,
        stall_margin_s: float = STALL_MARGIN_S,
        on_restart: Callable[[str], None] | None = None,
    ) -> None:
        """`on_restart(reason)` is called on the caller's event loop after each pool restart."""
        self.task = task
        self.timeout_s = timeout_s
        self.workers = workers
        self.stall_limit_s = timeout_s + CONSTS.term_timeout + stall_margin_s
        self.on_restart = on_restart
        self.counts = RewardCounts()
        # task.reward names a reward model: its replicas (handed to every call: a restarted replica has a
        # new address) and the outcomes of the calls to them
        self.uses_model = task.reward.startswith((JUDGE_PREFIX, CLASSIFIER_PREFIX))
        self.endpoints: list[RewardEndpoint] = []
        self.model_counts = RewardModelCounts()
        self.pool_restarts = 0  # pools found wedged or broken, stopped and started anew
        self.last_error = ""  # why the last reward that was not REWARD_OK failed, for the user's eyes
        self.failure = ""  # why the last restart failed ('' = it did not): the engine is then unhealthy
        self._waiting = 0  # calls waiting on the pool
        self._progress_at = time.monotonic()  # the last call resolved (or the pool went from idle to busy)
        self._rebuilding: concurrent.futures.Future[pebble.ProcessPool] | None = None
        self._restart_reason = ""
        self._rebuilder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reward-pool-restart")
        self._pool = self._new_pool()

    def _new_pool(self) -> pebble.ProcessPool:
        return pebble.ProcessPool(
            max_workers=self.workers,
            initializer=reward_worker.init_worker,
            initargs=(self.task, list(sys.path), os.getpid()),
            context=_context(self.task),
        )

    def start(self) -> None:
        """Start the workers now (blocking: call it off the event loop). A pool not started forks its
        workers at its first call, on the caller's thread."""
        _ = self._pool.active  # pebble starts a pool when asked for its status

    def stalled_s(self) -> float:
        """Seconds calls have waited without any call resolving (0 when none waits)."""
        return time.monotonic() - self._progress_at if self._waiting else 0.0

    def healthy(self) -> bool:
        """False when a restart failed, or calls wait far past the point where the pool should have been
        restarted: the engine cannot score any more and must be replaced."""
        return not self.failure and self.stalled_s() <= self.stall_limit_s + STOP_TIMEOUT_S + JOIN_TIMEOUT_S

    async def score(self, sample: Sample) -> tuple[float, int]:
        """(reward, status): status is REWARD_OK, or REWARD_ERROR, REWARD_TIMEOUT, REWARD_CRASH
        with reward 0."""
        value, status, outcome = await self._run(sample)
        if self.uses_model:
            self._count_model(status, outcome)
        if status == REWARD_OK:
            self.counts.ok += 1
        elif status == REWARD_TIMEOUT:
            self.counts.timeout += 1
        elif status == REWARD_CRASH:
            self.counts.crash += 1
        else:
            self.counts.error += 1
            if self.counts.error <= LOGGED_ERRORS:
                print(reward_error_line(sample, self.last_error, self.counts.error), flush=True)
        return value, status

    def _count_model(self, status: int, outcome: str) -> None:
        """A reward-model call's outcome: the worker's (ok, unparseable), or how the call failed. A worker
        killed past task.reward_timeout_s counts as a timeout too."""
        c = self.model_counts
        c.calls += 1
        if status == REWARD_OK:
            c.ok += outcome == OK
            c.unparseable += outcome != OK
        elif status == REWARD_TIMEOUT or outcome == RewardModelTimeout.__name__:
            c.timeouts += 1
        else:
            c.failures += 1

    async def _run(self, sample: Sample) -> tuple[float, int, str]:
        """(reward, status, outcome): the worker's outcome ('' for a plain reward function) when it
        answered, else the name of the exception a reward raised ('' when none: timeouts, crashes)."""
        for _ in range(3):
            if self._rebuilding is not None:
                await self._restarted()
            pool = self._pool
            try:
                future = pool.schedule(reward_worker.score, args=(sample, self.endpoints), timeout=self.timeout_s)
            except RuntimeError:  # the pool is broken: see below
                await self._restart(pool, wedged=False)
                continue
            try:
                value, outcome = await self._result(pool, future)
                return value, REWARD_OK, outcome
            except PoolWedged:
                started = future.running()
                await self._restart(pool, wedged=True)
                if not started:  # it never ran: it runs on the new pool
                    continue
                self.last_error = f"timeout: the reward pool made no progress for {self.stall_limit_s:g} s; restarted"
                return 0.0, REWARD_TIMEOUT, ""
            except TimeoutError:
                # pebble's own timeout carries no remote traceback; a TimeoutError the reward raised does
                # (asyncio re-creates TimeoutErrors without their cause: read the original).
                error = future.exception()
                if isinstance(error.__cause__, RemoteTraceback):
                    self.last_error = f"TimeoutError: {error}"
                    return 0.0, REWARD_ERROR, type(error).__name__
                self.last_error = f"timeout: running past {self.timeout_s} s"
                return 0.0, REWARD_TIMEOUT, ""
            except pebble.ProcessExpired as exc:
                # its worker died mid-call (a crash, a signal); pebble starts another
                self.last_error = f"crash: the reward worker exited with code {exc.exitcode}"
                return 0.0, REWARD_CRASH, ""
            except BrokenProcessPool:
                # pebble gives up its pool when a worker dies with no call running (killed while idle);
                # this call had not started: it runs again on a fresh pool.
                await self._restart(pool, wedged=False)
            except Exception as exc:
                self.last_error = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line
                return 0.0, REWARD_ERROR, type(exc).__name__
        self.last_error = self.failure or "crash: the reward pool broke three times"
        return 0.0, REWARD_CRASH, ""

    async def _result(self, pool: pebble.ProcessPool, future: concurrent.futures.Future) -> tuple[float, str]:
        """The call's result; PoolWedged once the pool made no progress for stall_limit_s (or another
        call restarted it)."""
        waiter = asyncio.wrap_future(future)
        if not self._waiting:
            self._progress_at = time.monotonic()  # idle until now: not a stall
        self._waiting += 1
        try:
            while True:
                left = self._progress_at + self.stall_limit_s - time.monotonic()
                if self._pool is not pool or left <= 0:
                    waiter.cancel()
                    raise PoolWedged
                # short waits: a restart by another call is noticed within a fraction of a second
                done, _ = await asyncio.wait({waiter}, timeout=min(left, 0.5))
                if done:
                    self._progress_at = time.monotonic()
                    return waiter.result()
        finally:
            self._waiting -= 1

    async def _restart(self, broken: pebble.ProcessPool, wedged: bool) -> None:
        """Replace `broken` once (concurrent callers all wait for the same replacement)."""
        if self._pool is broken and self._rebuilding is None:
            self._restart_reason = f"no progress for {self.stall_limit_s:g} s" if wedged else "broken"
            self._rebuilding = self._rebuilder.submit(self._rebuild, broken, wedged)
        if self._rebuilding is not None:
            await self._restarted()

    async def _restarted(self) -> None:
        rebuilding = self._rebuilding
        try:
            pool = await asyncio.wrap_future(rebuilding)
        except Exception as exc:
            if self._rebuilding is rebuilding:  # the broken pool stays; the next call tries again
                self._rebuilding = None
                self.failure = f"the reward pool could not be restarted: {type(exc).__name__}: {exc}"
            return
        if self._rebuilding is rebuilding:  # the first caller back installs it
            self._rebuilding = None
            self._pool = pool
            self.pool_restarts += 1
            self.failure = ""
            self._progress_at = time.monotonic()
            if self.on_restart is not None:
                self.on_restart(self._restart_reason)

    def _rebuild(self, broken: pebble.ProcessPool, wedged: bool) -> pebble.ProcessPool:
        """On the restart thread: kill a wedged pool's processes, stop and join it, start a new one."""
        if wedged:
            kill_pool_processes(broken)
        if not stop(broken):
            raise RuntimeError("the old pool did not stop after its processes were killed")
        pool = self._new_pool()
        _ = pool.active  # forks its workers here, not on the caller's event loop
        return pool

    def close(self) -> None:
        """Stop the workers now (a call still running is killed)."""
        pools = [self._pool]
        if self._rebuilding is not None and self._rebuilding.done() and self._rebuilding.exception() is None:
            pools.append(self._rebuilding.result())
        for pool in pools:
            stop(pool)
        self._rebuilder.shutdown(wait=False)


def stop(pool: pebble.ProcessPool) -> bool:
    """Stop and join `pool`; one that does not stop in time (its fork server stalls) has its processes
    killed first. False if it still did not stop (its threads are daemons: abandoned)."""
    if stop_and_join(pool, STOP_TIMEOUT_S):
        return True
    kill_pool_processes(pool)
    return stop_and_join(pool, JOIN_TIMEOUT_S)


def stop_and_join(pool: pebble.ProcessPool, timeout_s: float) -> bool:
    """Stop `pool` and wait for its threads and workers; False if that took longer than `timeout_s`
    (pebble's join waits without a limit for a stop, so it runs on a daemon thread)."""
    pool.stop()
    joiner = threading.Thread(target=pool.join, name="reward-pool-join", daemon=True)
    joiner.start()
    joiner.join(timeout_s)
    return not joiner.is_alive()


def kill_pool_processes(pool: pebble.ProcessPool) -> None:
    """SIGKILL every worker of `pool` and, under the fork server, the server and all its children. A
    killed server reads as exit code 255 to everything that waits on one of its workers (pebble's
    blocked join included), and the next worker start launches a new server. The server serves this
    process alone: in an engine, that is its one reward pool."""
    pids = set(_worker_pids(pool))
    server = multiprocessing.forkserver._forkserver._forkserver_pid  # CPython's; None until started
    if START_METHOD == "forkserver" and server is not None:
        pids.update(_children(server))
    for pid in pids:
        _kill(pid)
    if START_METHOD == "forkserver" and server is not None:
        _kill(server)
        # Not reaped here: the next start checks the old server with waitpid and starts a new one
        # once it has exited. Wait until it has, or that check would find it alive and use it.
        deadline = time.monotonic() + 5.0
        while _state(server) not in ("Z", "") and time.monotonic() < deadline:
            time.sleep(0.01)


def _worker_pids(pool: pebble.ProcessPool) -> list[int]:
    # pebble keeps no public list of its workers; a worker it already dropped (the one it is stuck
    # stopping) is a child of the fork server and found there.
    manager = getattr(pool, "_pool_manager", None)
    workers = getattr(getattr(manager, "worker_manager", None), "workers", {})
    return [pid for pid in list(workers) if isinstance(pid, int)]


def _children(parent: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent:
            found.append(int(stat.parent.name))
    return found


def _state(pid: int) -> str:
    """The process's state letter ('R', 'S', 'T', 'Z', ...), '' if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def reward_error_line(sample: Sample, error: str, nth: int) -> str:
    """One line naming a sample whose reward raised: its prompt, text, finish reason, last tokens and
    the exception (the engine's log, so a rare failure can be read after the run)."""
    prompt = sample.prompt.text or " | ".join(m.content for m in sample.prompt.messages)
    more = "; later reward errors are counted, not logged" if nth == LOGGED_ERRORS else ""
    return (
        f"[reward] error {nth} on prompt {sample.prompt.prompt_id} ({prompt[:SHOWN_CHARS]!r}): {error}; "
        f"finish reason {sample.finish_reason}, {len(sample.completion_ids)} tokens ending "
        f"{sample.completion_ids[-4:]}, text {sample.completion[-SHOWN_CHARS:]!r}{more}"
    )
