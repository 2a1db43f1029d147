"""The prompt source: the prompts a run generates from, in the order they are leased, rendered.

Prompts handed back (their engine drained or died, or they were in flight at a checkpoint) come
first; then fresh ones from the stream: a task's seeded stream, or the rows of data.train_files,
shuffled by seed anew each epoch, for data.epochs passes (then the stream ends). Every fresh prompt
is rendered once here into `Prompt.token_ids` (see chat.py) before it is leased. A task's prompt
that cannot be rendered (empty, too long, chat without a template) is skipped and counted by
reason; file rows were checked when the files were loaded (data.py).

The source keeps its exact position (epoch, index) so a restarted buffer or a resumed run
continues with the very prompt the last one would have drawn next.
"""

from __future__ import annotations

import abc
import collections
import itertools
from collections.abc import Iterable, Iterator

import msgspec
import numpy as np

from async_rl.chat import PromptRenderer, RenderError
from async_rl.config import DataConfig, VisionConfig
from async_rl.errors import RunError
from async_rl.protocol import Prompt
from async_rl.tasks.registry import load_task

# A task stream whose prompts are all unusable would otherwise spin forever: after this many bad
# prompts in a row the run stops with one line naming why.
MAX_CONSECUTIVE_BAD = 1000


class DataPosition(msgspec.Struct, frozen=True, kw_only=True):
    """Where the stream is: `index` items of epoch `epoch`'s order taken (a task stream: epoch 0,
    items taken from the task's stream, skipped ones included)."""

    epoch: int = 0
    index: int = 0


class PromptStream(abc.ABC):
    """Fresh prompts in order; `next()` is None once the stream ended."""

    skipped: collections.Counter[str]

    @abc.abstractmethod
    def next(self) -> Prompt | None: ...

    @property
    @abc.abstractmethod
    def position(self) -> DataPosition: ...

    @abc.abstractmethod
    def seek(self, position: DataPosition, skipped: dict[str, int]) -> None:
        """Continue at `position` (what an earlier run with the same settings had reached), with the
        skip counts that run had saved."""


class TaskStream(PromptStream):
    def __init__(self, task_name: str, seed: int, renderer: PromptRenderer | None, max_prompt_tokens: int) -> None:
        self._task_name = task_name
        self._seed = seed
        self._renderer = renderer
        self._max_prompt_tokens = max_prompt_tokens
        self._it: Iterator[Prompt] = load_task(task_name).prompts(seed)
        self._taken = 0
        self.skipped = collections.Counter()

    @property
    def position(self) -> DataPosition:
        return DataPosition(epoch=0, index=self._taken)

    def seek(self, position: DataPosition, skipped: dict[str, int]) -> None:
        self.skipped = collections.Counter(skipped)  # bad prompts are found while drawing: saved counts
        self._it = load_task(self._task_name).prompts(self._seed)
        collections.deque(itertools.islice(self._it, position.index), maxlen=0)
        self._taken = position.index

    def next(self) -> Prompt | None:
        last_error = ""
        for _ in range(MAX_CONSECUTIVE_BAD):
            prompt = next(self._it, None)
            if prompt is None:
                return None
            self._taken += 1
            if not prompt.data_source:
                prompt = msgspec.structs.replace(prompt, data_source=self._task_name)
            if self._renderer is None:  # no model to render with (buffer tests): leased as given
                return prompt
            try:
                return self._renderer.rendered(prompt, self._max_prompt_tokens)
            except RenderError as exc:
                self.skipped[exc.reason] += 1
                last_error = str(exc)
        raise RunError(
            f"task.name '{self._task_name}': {MAX_CONSECUTIVE_BAD} prompts in a row cannot be rendered "
            f"(last: {last_error}); skipped so far: {dict(self.skipped)}"
        )


class DatasetStream(PromptStream):
    def __init__(self, prompts: list[Prompt], epochs: int, shuffle: bool, seed: int, skipped: collections.Counter[str]) -> None:
        self._prompts = prompts
        self._epochs = epochs
        self._shuffle = shuffle
        self._seed = seed
        self.skipped = skipped  # bad rows skipped at load time (data.skip_bad_rows)
        self._epoch = 0
        self._index = 0
        self._order = self.order(0)

    def order(self, epoch: int) -> np.ndarray:
        """The row order of `epoch`: a permutation seeded by (data.seed, epoch), or file order."""
        n = len(self._prompts)
        if not self._shuffle:
            return np.arange(n)
        return np.random.default_rng([self._seed, epoch]).permutation(n)

    @property
    def position(self) -> DataPosition:
        return DataPosition(epoch=self._epoch, index=self._index)

    def seek(self, position: DataPosition, skipped: dict[str, int]) -> None:
        # `skipped` is not taken over: bad rows are counted anew when the same files are loaded.
        if position.index > len(self._prompts):
            raise RunError(
                f"data position {position} is past the {len(self._prompts)} rows of data.train_files: "
                "the files changed since the checkpoint"
            )
        self._epoch, self._index = position.epoch, position.index
        self._order = self.order(self._epoch)

    def next(self) -> Prompt | None:
        n = len(self._prompts)
        if self._index >= n:
            self._epoch, self._index = self._epoch + 1, 0
            self._order = self.order(self._epoch)
        if self._epoch >= self._epochs or n == 0:
            return None
        row = int(self._order[self._index])
        # Unique over the run: one id per (epoch, index) drawn.
        prompt = msgspec.structs.replace(self._prompts[row], prompt_id=self._epoch * n + self._index)
        self._index += 1
        return prompt


class PromptSource:
    def __init__(self, stream: PromptStream) -> None:
        self._stream = stream
        self._drawn = 0  # fresh prompts taken from the stream so far
        self._returned: collections.deque[Prompt] = collections.deque()  # handed back, leased first
        self._ended = False  # the stream ran out
        self._rising_ids = False  # train.deterministic: fresh prompt ids must rise (see require_rising_ids)
        self._last_id = -1

    @classmethod
    def from_settings(
        cls,
        task_name: str,
        task_seed: int,
        model_dir: str,
        max_prompt_tokens: int,
        data: DataConfig,
        tokenizer_class: str = "",
        vision: VisionConfig | None = None,
    ) -> PromptSource:
        """data.train_files set: their rows (loaded, checked and rendered now); else the task's stream.
        `model_dir` '' renders nothing (prompts leased as the task gives them: buffer tests);
        `tokenizer_class`: chat.tokenizer_class_of(model_dir), '' = AutoTokenizer."""
        renderer = (
            PromptRenderer(model_dir, data.system_prompt, data.chat_template_for_text, tokenizer_class, vision)
            if model_dir
            else None
        )
        if data.train_files:
            from async_rl.data import load_prompt_files

            if renderer is None:
                raise RunError("data.train_files needs the model's tokenizer: the buffer was given no model_dir")
            loaded = load_prompt_files(data.train_files, data, renderer, max_prompt_tokens, "data.train_files")
            return cls(DatasetStream(loaded.prompts, data.epochs, data.shuffle, data.seed, loaded.skipped))
        return cls(TaskStream(task_name, task_seed, renderer, max_prompt_tokens))

    @property
    def drawn(self) -> int:
        return self._drawn

    @property
    def position(self) -> DataPosition:
        return self._stream.position

    @property
    def skipped(self) -> dict[str, int]:
        """Prompts or rows that could not be used, by reason."""
        return dict(self._stream.skipped)

    @property
    def exhausted(self) -> bool:
        """A finite stream ran out and nothing handed back waits: no prompt will come any more."""
        return self._ended and not self._returned

    def take(self, n: int) -> list[Prompt]:
        """Up to `n` prompts: handed-back ones first, then fresh ones (fewer when the stream ran out)."""
        prompts = [self._returned.popleft() for _ in range(min(n, len(self._returned)))]
        while len(prompts) < n and not self._ended:
            prompt = self._stream.next()
            if prompt is None:
                self._ended = True
                break
            self._drawn += 1
            if self._rising_ids:
                if prompt.prompt_id <= self._last_id:
                    raise RunError(
                        f"train.deterministic: the prompt stream gave prompt id {prompt.prompt_id} after "
                        f"{self._last_id}; a deterministic run orders its batches by prompt id, which must rise"
                    )
                self._last_id = prompt.prompt_id
            prompts.append(prompt)
        return prompts

    def require_rising_ids(self) -> None:
        """train.deterministic: a batch is its step's prompts in prompt-id order, so each fresh prompt
        must have a higher id than the one before (the built-in tasks and data files count up)."""
        self._rising_ids = True

    def give_back(self, prompts: Iterable[Prompt]) -> None:
        """These prompts are leased again before any fresh one."""
        self._returned.extend(prompts)

    def returned(self) -> list[Prompt]:
        """The handed-back prompts not yet leased again, in lease order."""
        return list(self._returned)

    def seek(self, position: DataPosition, drawn: int, skipped: dict[str, int] | None = None) -> None:
        """Continue where an earlier run stopped: at `position`, with `drawn` fresh prompts taken and
        (a task stream) `skipped` counted so far."""
        self._stream.seek(position, skipped or {})
        self._drawn = drawn
        self._ended = False
