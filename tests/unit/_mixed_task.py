"""A finite task for test_data.py whose stream holds bad prompts among good ones."""

from __future__ import annotations

from collections.abc import Iterator

from async_rl.protocol import ChatMessage, Prompt, Sample
from async_rl.tasks.base import Task


class MixedTask(Task):
    name = "mixed"

    def prompts(self, seed: int) -> Iterator[Prompt]:
        yield Prompt(prompt_id=0, text="a:", answer="a")
        yield Prompt(prompt_id=1, text="   ")  # empty
        yield Prompt(prompt_id=2, text="b" * 500)  # longer than the model allows
        yield Prompt(prompt_id=3, messages=[ChatMessage(role="user", content="c:")])  # needs a chat template
        yield Prompt(prompt_id=4, text="d:", answer="d")

    def reward(self, sample: Sample) -> float:
        return 0.0


def make_task() -> Task:
    return MixedTask()
