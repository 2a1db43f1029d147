"""The end-to-end benchmark's task: 'repeat' behind a fixed context of CONTEXT_CHARS characters.

Real RL prompts (a maths problem, a chat history) are long next to the reward-bearing answer. A long
prompt costs the learner a forward and backward pass over every prompt token of every sample, but the
generator only one batched prefill per prompt, so it is what brings training and generation of the
tiny model into balance (bench_e2e.py prints the balance it measured). Loaded by name,
`task.name=benchmarks.e2e_task:make_task`, with the repository root on PYTHONPATH.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from async_rl.protocol import Prompt
from async_rl.tasks.repeat import RepeatTask

CONTEXT_CHARS = 192
# One fixed context for every prompt, from the tiny tokenizer's characters (one token each).
CONTEXT = "".join(random.Random(1234).choice("0123456789ijklmnopqrstuvwxyz+-*=,. ") for _ in range(CONTEXT_CHARS))


class ContextRepeatTask(RepeatTask):
    name = "repeat-context"

    def prompts(self, seed: int) -> Iterator[Prompt]:
        for p in super().prompts(seed):
            yield Prompt(prompt_id=p.prompt_id, text=CONTEXT + p.text, answer=p.answer)


def make_task() -> ContextRepeatTask:
    return ContextRepeatTask()
