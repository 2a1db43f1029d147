"""A user task whose reward takes a while: an engine then holds leases (groups being scored) at any
moment, so a crash test finds prompts in flight to hand back."""

from __future__ import annotations

import threading

from async_rl.protocol import Sample
from async_rl.tasks.repeat import RepeatTask

SCORE_S = 0.5


class SlowRepeatTask(RepeatTask):
    name = "slow_repeat"

    def reward(self, sample: Sample) -> float:
        threading.Event().wait(SCORE_S)
        return super().reward(sample)


def make_task() -> SlowRepeatTask:
    return SlowRepeatTask()
