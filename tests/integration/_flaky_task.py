"""A user task (loaded by dotted path) whose reward function sometimes raises and sometimes hangs."""

from __future__ import annotations

import threading

from async_rl.protocol import Sample
from async_rl.tasks.repeat import RepeatTask

HANG_S = 1.0  # well past the test's task.reward_timeout_s


class FlakyRepeatTask(RepeatTask):
    name = "flaky_repeat"

    def reward(self, sample: Sample) -> float:
        if sample.prompt.prompt_id % 5 == 1:
            raise ValueError("reward service unavailable")
        if sample.prompt.prompt_id % 5 == 3:
            threading.Event().wait(HANG_S)  # a reward that hangs; the runner must time it out
        return super().reward(sample)


def make_task() -> FlakyRepeatTask:
    return FlakyRepeatTask()
