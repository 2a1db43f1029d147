"""The Task interface. Loading a task by name lives in `async_rl.tasks.registry`, which imports the
built-in tasks (they import this module, so the base cannot import them)."""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Iterator

from async_rl.protocol import Prompt, Sample


class Task(abc.ABC):
    """A verifiable task. `prompts` runs in the buffer (admission control leases them); `reward` runs
    in the reward worker processes of every generator engine, under a timeout. A task is rebuilt by
    name in each of those processes (`load_task`), never pickled."""

    name: str = "task"

    @abc.abstractmethod
    def prompts(self, seed: int) -> Iterator[Prompt]:
        """An endless (or long) stream of prompts with unique `prompt_id`s."""

    @abc.abstractmethod
    def reward(self, sample: Sample) -> float | Awaitable[float]:
        """Score one finished completion (`sample.prompt` holds the answer and metadata); a finite
        float, higher is better. May be `async def` (remote reward models, sandboxes)."""
