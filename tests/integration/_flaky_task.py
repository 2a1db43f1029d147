"""A user task (loaded by dotted path) whose reward function sometimes raises, sometimes hangs and
sometimes kills its own worker process."""

from __future__ import annotations

import os
import signal
import threading

from async_rl.protocol import Sample
from async_rl.tasks.repeat import RepeatTask

HANG_S = 60.0  # far past the test's task.reward_timeout_s: the runner kills the worker at the timeout


class FlakyRepeatTask(RepeatTask):
    name = "flaky_repeat"

    def reward(self, sample: Sample) -> float:
        if sample.prompt.prompt_id % 5 == 1:
            raise ValueError("reward service unavailable")
        if sample.prompt.prompt_id % 5 == 3:
            threading.Event().wait(HANG_S)  # a reward that hangs; the runner must time it out
        if sample.prompt.prompt_id % 5 == 4:
            os.kill(os.getpid(), signal.SIGKILL)  # a reward that crashes its worker; the runner replaces it
        return super().reward(sample)


def make_task() -> FlakyRepeatTask:
    return FlakyRepeatTask()
