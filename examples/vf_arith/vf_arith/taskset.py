"""The task, its reward and its harness (see the package doc)."""

from __future__ import annotations

import re

import verifiers.v1 as vf
from verifiers.v1.harnesses.null import NullHarness

BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
ROWS = [("What is 17 + 25?", "42"), ("What is 9 * 8?", "72"), ("What is 100 - 37?", "63")]


def boxed_number(text: str) -> str | None:
    """The last \\boxed{} of `text`, without spaces or thousands separators (None: no box)."""
    found = BOXED.findall(text)
    return found[-1].replace(",", "").replace(" ", "") if found else None


class ArithData(vf.TaskData):
    answer: str = ""
    """The reference number."""


class ArithTask(vf.Task[ArithData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1 when the last reply's last \\boxed{} is the reference number."""
        return float(boxed_number(trace.last_reply) == self.data.answer.strip())


class ArithTaskset(vf.Taskset[ArithTask, vf.TasksetConfig]):
    def load(self) -> list[ArithTask]:
        return [ArithTask(ArithData(prompt=q, answer=a), self.config.task) for q, a in ROWS]


class ArithHarness(NullHarness):
    """verifiers' tool-less chat loop as this taskset's default harness (the built-in default, `bash`,
    would hand the model a shell)."""
