"""'reasoning_gym:<dataset>': procedural tasks of the reasoning-gym library, scored by the dataset's
own `score_answer`.

Prompt format: a chat of two messages, reasoning-gym's default system prompt (think step by step,
then give only the final answer as `<answer>...</answer>`) and the question as the user message.
The answer is what the completion's last `<answer>...</answer>` holds (reasoning-gym's
`extract_answer`); a completion without one scores 0.

The stream is endless and seeded: prompt i is entry i % CHUNK of a dataset of CHUNK entries whose
seed is derived from (task.seed, i // CHUNK). Datasets are built per chunk because some precompute
per entry of their size. `Prompt.metadata` keeps the chunk seed and the entry index (scalars), so a
reward worker process rebuilds the same entry to score it.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator
from typing import Any

from async_rl.errors import ConfigError
from async_rl.protocol import ChatMessage, Prompt, Sample
from async_rl.tasks.base import Task

PREFIX = "reasoning_gym:"
CHUNK = 1000
_SEED_KEY = "rg_seed"
_INDEX_KEY = "rg_index"


def chunk_seed(seed: int, chunk: int) -> int:
    """A 32-bit seed per (task seed, chunk); string seeding is deterministic across processes."""
    return random.Random(f"{seed}:{chunk}").getrandbits(32)


@functools.lru_cache(maxsize=8)
def _dataset(name: str, seed: int) -> Any:
    from reasoning_gym import create_dataset

    return create_dataset(name, seed=seed, size=CHUNK)


class ReasoningGymTask(Task):
    def __init__(self, dataset: str) -> None:
        from reasoning_gym.factory import DATASETS

        if dataset not in DATASETS:
            raise ConfigError(
                f"task.name '{PREFIX}{dataset}': reasoning-gym has no dataset '{dataset}' (list them with "
                "python -c 'import reasoning_gym.factory as f; print(sorted(f.DATASETS))')"
            )
        self.dataset = dataset
        self.name = PREFIX + dataset

    def prompts(self, seed: int) -> Iterator[Prompt]:
        from reasoning_gym.utils import SYSTEM_PROMPTS

        system = ChatMessage(role="system", content=SYSTEM_PROMPTS["default"])
        i = 0
        while True:
            rg_seed, index = chunk_seed(seed, i // CHUNK), i % CHUNK
            entry = _dataset(self.dataset, rg_seed)[index]
            yield Prompt(
                prompt_id=i,
                messages=[system, ChatMessage(role="user", content=entry["question"])],
                answer="" if entry["answer"] is None else str(entry["answer"]),
                data_source=entry.get("metadata", {}).get("source_dataset", self.dataset),
                metadata={_SEED_KEY: rg_seed, _INDEX_KEY: index},
            )
            i += 1

    def reward(self, sample: Sample) -> float:
        from reasoning_gym.utils import extract_answer

        meta = sample.prompt.metadata
        seed, index = meta.get(_SEED_KEY), meta.get(_INDEX_KEY)
        if not isinstance(seed, int) or not isinstance(index, int):
            raise ValueError(f"prompt {sample.prompt.prompt_id} has no reasoning-gym entry in its metadata")
        dataset = _dataset(self.dataset, seed)
        return float(dataset.score_answer(extract_answer(sample.completion), dataset[index]))
