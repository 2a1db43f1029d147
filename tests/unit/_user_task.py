"""A user task for test_tasks.py, loaded through `task.name = 'tests.unit._user_task:make_task'`."""

from __future__ import annotations

from collections.abc import Iterator

from async_rl.protocol import Prompt, Sample
from async_rl.tasks.base import Task


class EchoTask(Task):
    name = "echo"

    def prompts(self, seed: int) -> Iterator[Prompt]:
        i = 0
        while True:
            yield Prompt(prompt_id=1000 * seed + i, text=f"say {i}", answer=str(i))
            i += 1

    def reward(self, sample: Sample) -> float:
        return 1.0 if sample.completion.strip() == sample.prompt.answer else 0.0


def make_task() -> Task:
    return EchoTask()


def make_not_a_task():
    return {"reward": lambda p, c: 1.0}


NOT_CALLABLE = 3


class AsyncEchoTask(EchoTask):
    name = "async_echo"

    async def reward(self, sample: Sample) -> float:  # an async reward, as a remote reward model's client
        return super().reward(sample)


def make_async_task() -> Task:
    return AsyncEchoTask()
