"""Run a task's reward function off the event loop, under a timeout; failures score 0 and are counted."""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor

from async_rl.protocol import REWARD_ERROR, REWARD_OK, REWARD_TIMEOUT, Prompt
from async_rl.tasks.base import Task


class RewardRunner:
    def __init__(self, task: Task, timeout_s: float, workers: int) -> None:
        self.task = task
        self.timeout_s = timeout_s
        # A timed-out call keeps its thread until it returns (Python cannot kill threads); the
        # pool bounds how many such calls can pile up.
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward")

    def _call(self, prompt: Prompt, completion: str) -> float:
        value = float(self.task.reward(prompt, completion))
        if not math.isfinite(value):
            raise ValueError(f"reward is not finite: {value}")
        return value

    async def score(self, prompt: Prompt, completion: str) -> tuple[float, int]:
        """(reward, status): status is REWARD_OK, REWARD_ERROR or REWARD_TIMEOUT (reward 0 then)."""
        loop = asyncio.get_running_loop()
        try:
            fut = loop.run_in_executor(self._pool, self._call, prompt, completion)
            return await asyncio.wait_for(fut, self.timeout_s), REWARD_OK
        except asyncio.TimeoutError:
            return 0.0, REWARD_TIMEOUT
        except Exception:
            return 0.0, REWARD_ERROR

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
