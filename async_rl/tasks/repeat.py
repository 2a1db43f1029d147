"""'repeat': the prompt names a letter, the completion should repeat it. Dense, easy to verify.

Prompt 'c:' -> ideal completion 'cccccccc'. Reward = fraction of the first `length` characters of
the completion that equal the letter (a short or wrong completion scores less). A random policy
scores about 1/48 per character on the tiny preset, so learning shows within minutes on 2 cores.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from async_rl.protocol import Prompt, Sample
from async_rl.tasks.base import Task

LETTERS = "abcdefgh"


class RepeatTask(Task):
    name = "repeat"

    def __init__(self, length: int = 8, letters: str = LETTERS) -> None:
        self.length = length
        self.letters = letters

    def prompts(self, seed: int) -> Iterator[Prompt]:
        rng = random.Random(seed)
        i = 0
        while True:
            letter = rng.choice(self.letters)
            yield Prompt(prompt_id=i, text=f"{letter}:", answer=letter)
            i += 1

    def reward(self, sample: Sample) -> float:
        head = sample.completion[: self.length]
        return sum(1 for ch in head if ch == sample.prompt.answer) / self.length
