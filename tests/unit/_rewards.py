"""User reward functions for test_tasks.py, loaded in reward worker processes through
`task.reward = 'tests.unit._rewards:<fn>'`. Tests steer them through the prompt's metadata."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from pathlib import Path

from async_rl.protocol import Sample


def length(sample: Sample) -> float:
    return len(sample.completion) / 10


def value(sample: Sample):
    """Returns metadata['value'] as it is (tests pass non-numbers and non-finite floats)."""
    return sample.prompt.metadata["value"]


def whoami(sample: Sample) -> float:
    """The worker's pid, and the whole Sample arrived: answer, ids and finish reason."""
    assert sample.prompt.answer == "c" and sample.completion_ids == [5, 6] and sample.finish_reason == "length"
    return float(os.getpid())


def boom(sample: Sample) -> float:
    raise RuntimeError("user bug")


def raises_timeout_error(sample: Sample) -> float:
    raise TimeoutError("the reward service timed out")  # the reward's own error, not the runner's timeout


def wait(sample: Sample) -> float:
    """Sleeps metadata['wait_s'] seconds, then scores 1. 'hang' in the completion: writes the worker's
    pid to metadata['pid_file'] and hangs."""
    if sample.completion == "hang":
        pid_file = sample.prompt.metadata.get("pid_file")
        if isinstance(pid_file, str):
            Path(pid_file + ".tmp").write_text(str(os.getpid()))
            os.replace(pid_file + ".tmp", pid_file)
        threading.Event().wait(600)
    threading.Event().wait(float(sample.prompt.metadata.get("wait_s", 0.0)))
    return 1.0


async def async_length(sample: Sample) -> float:
    """An async reward: awaits (as a remote call would) on the worker's event loop."""
    await asyncio.sleep(0.01)
    return len(sample.completion) / 10


def ignores_sigterm(sample: Sample) -> float:
    """Like `wait`, but a 'hang' ignores SIGTERM first (only SIGKILL stops it)."""
    if sample.completion == "hang":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return wait(sample)


def pid(sample: Sample) -> float:
    """The pid of the worker that scored the sample."""
    return float(os.getpid())
