"""The prompt source: the prompts a run generates from, in the order they are leased.

Prompts handed back (their engine drained or died, or they were in flight at a checkpoint) come
first; then fresh ones from the task's seeded stream. The source keeps its position in that stream
(`drawn`) so a restarted buffer or a resumed run continues exactly where the last one stopped.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Iterator

from async_rl.protocol import Prompt
from async_rl.tasks.base import load_task


class PromptSource:
    def __init__(self, task_name: str, seed: int) -> None:
        self._task_name = task_name
        self._seed = seed
        self._stream: Iterator[Prompt] = load_task(task_name).prompts(seed)
        self._drawn = 0  # fresh prompts taken from the stream so far
        self._returned: collections.deque[Prompt] = collections.deque()  # handed back, leased first

    @property
    def drawn(self) -> int:
        return self._drawn

    def take(self, n: int) -> list[Prompt]:
        """Up to `n` prompts: handed-back ones first, then fresh ones (fewer when a finite stream ran out)."""
        prompts = [self._returned.popleft() for _ in range(min(n, len(self._returned)))]
        fresh = list(itertools.islice(self._stream, n - len(prompts)))
        self._drawn += len(fresh)
        return prompts + fresh

    def give_back(self, prompts: Iterable[Prompt]) -> None:
        """These prompts are leased again before any fresh one."""
        self._returned.extend(prompts)

    def returned(self) -> list[Prompt]:
        """The handed-back prompts not yet leased again, in lease order."""
        return list(self._returned)

    def seek(self, drawn: int) -> None:
        """Restart the seeded stream and skip the `drawn` prompts an earlier run already took."""
        self._stream = load_task(self._task_name).prompts(self._seed)
        collections.deque(itertools.islice(self._stream, drawn), maxlen=0)
        self._drawn = drawn
