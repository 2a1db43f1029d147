"""Run a task's reward function off the event loop, under a timeout; failures score 0 and are counted."""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor

from async_rl.protocol import REWARD_ERROR, REWARD_OK, REWARD_TIMEOUT, Sample
from async_rl.tasks.base import Task

_QUEUE_FACTOR = 10


class RewardRunner:
    def __init__(self, task: Task, timeout_s: float, workers: int) -> None:
        self.task = task
        self.timeout_s = timeout_s
        # A timed-out call keeps its thread until it returns (Python cannot kill threads); the
        # pool bounds how many such calls can pile up.
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward")
        # The timeout starts when a call gets a worker, not while it queues behind others.
        self._slots = asyncio.Semaphore(workers)

    def _call(self, sample: Sample) -> float:
        value = float(self.task.reward(sample))
        if not math.isfinite(value):
            raise ValueError(f"reward is not finite: {value}")
        return value

    async def score(self, sample: Sample) -> tuple[float, int]:
        """(reward, status): status is REWARD_OK, REWARD_ERROR or REWARD_TIMEOUT (reward 0 then)."""
        loop = asyncio.get_running_loop()
        try:
            # Queueing for a worker is bounded too: if every worker is stuck in a hung call, waiting
            # calls time out instead of stalling the engine.
            await asyncio.wait_for(self._slots.acquire(), _QUEUE_FACTOR * self.timeout_s)
        except asyncio.TimeoutError:
            return 0.0, REWARD_TIMEOUT
        fut = loop.run_in_executor(self._pool, self._call, sample)
        fut.add_done_callback(lambda _: self._slots.release())  # the slot is free when the thread is
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.timeout_s), REWARD_OK
        except asyncio.TimeoutError:
            return 0.0, REWARD_TIMEOUT
        except Exception:
            return 0.0, REWARD_ERROR

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
