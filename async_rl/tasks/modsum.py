"""'modsum': add two digits modulo 10. Prompt '3+5=' -> answer '8'. Reward 1 if the completion
starts with the right digit, else 0 (exact-match verification, as in math tasks)."""

from __future__ import annotations

import random
from collections.abc import Iterator

from async_rl.protocol import Prompt, Sample
from async_rl.tasks.base import Task


class ModSumTask(Task):
    name = "modsum"

    def prompts(self, seed: int) -> Iterator[Prompt]:
        rng = random.Random(seed)
        i = 0
        while True:
            a, b = rng.randrange(10), rng.randrange(10)
            yield Prompt(prompt_id=i, text=f"{a}+{b}=", answer=str((a + b) % 10))
            i += 1

    def reward(self, sample: Sample) -> float:
        return 1.0 if sample.completion.strip().startswith(sample.prompt.answer) else 0.0
