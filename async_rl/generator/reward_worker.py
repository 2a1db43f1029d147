"""What runs inside a reward worker process: the reward function is rebuilt once from the task
config (`init_worker`), then `score` is called once per sample. Module-level functions, so the pool
sends them by name."""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import select
import signal
import sys
import threading
from typing import TYPE_CHECKING

from async_rl.protocol import Sample

if TYPE_CHECKING:
    from async_rl.config import TaskConfig
    from async_rl.reward_models.calls import RewardModelCall
    from async_rl.reward_models.server import RewardEndpoint
    from async_rl.tasks.rewards import RewardFn

_reward_fn: RewardFn | RewardModelCall | None = None
_load_error = "init_worker was not called"
_loop: asyncio.AbstractEventLoop | None = None


def init_worker(task: TaskConfig, sys_path: list[str], owner_pid: int) -> None:
    """Build the reward function of `task`. A failure is kept and raised by every `score` (each
    sample counts as a reward error) instead of killing the worker, which the pool would only
    restart into the same failure."""
    global _reward_fn, _load_error
    _exit_with(owner_pid)
    # The pool stops a timed-out worker with SIGTERM and waits 3 s before SIGKILL, holding the pipe
    # every worker shares meanwhile. pebble's Python handler runs only between bytecodes, so a reward
    # stuck in C code that never checks for signals would stall the others: die at once instead.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.path[:0] = [p for p in sys_path if p not in sys.path]  # the engine's import path (user modules)
    try:
        from async_rl.tasks.rewards import load_reward

        _reward_fn = load_reward(task)
    except Exception as exc:
        _load_error = f"{type(exc).__name__}: {exc}"


def _exit_with(owner_pid: int) -> None:
    """Exit when the process that owns the pool (the engine) exits. A worker stuck in a hung reward
    never reads its pipe again, and the fork server outlives the engine while a worker it forked
    lives: without this both would outlast a killed engine."""
    try:
        pidfd = os.pidfd_open(owner_pid)  # Linux >= 5.3: readable once that process has exited
    except (AttributeError, OSError):
        return  # elsewhere a worker ends when its pipe closes, unless a reward hangs

    def watch() -> None:
        select.select([pidfd], [], [])
        os._exit(1)

    threading.Thread(target=watch, name="owner-watch", daemon=True).start()


def _event_loop() -> asyncio.AbstractEventLoop:
    # One loop per worker for its whole life: an async reward's clients (HTTP sessions) may outlive a call.
    global _loop
    if _loop is None:
        _loop = asyncio.new_event_loop()
    return _loop


def score(sample: Sample, endpoints: list[RewardEndpoint]) -> tuple[float, str]:
    """The reward of one sample: a finite float and the reward model's outcome ('' without one: see
    reward_models/calls.py), or an exception (counted as a reward error). `endpoints`: the reward
    model's replicas when task.reward names one."""
    from async_rl.reward_models.calls import RewardModelCall

    if _reward_fn is None:
        raise RuntimeError(f"the reward function did not load in the worker: {_load_error}")
    outcome = ""
    if isinstance(_reward_fn, RewardModelCall):
        value, outcome = _event_loop().run_until_complete(_reward_fn.score(sample, endpoints))
    else:
        value = _reward_fn(sample)
        if inspect.isawaitable(value):
            value = _event_loop().run_until_complete(value)
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"reward is not finite: {result}")
    return result, outcome
