"""Stand-in task for configs/smollm2_arith.yaml while dataset files, chat rendering and the math
reward are not on this branch: reads configs/data/arith_{train,eval}.jsonl, renders each question
with the model's chat template into `Prompt.text` (vLLM tokenizes it as is), scores the last number
of the completion against the answer (what math-verify reads from a plain completion).

Used as `task.name=benchmarks.arith_standin:make_task`. Remove once data.train_files, data.eval_files
and task.reward=math are merged.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Iterator
from pathlib import Path

from async_rl.protocol import Prompt, Sample
from async_rl.tasks.base import Task

DATA = Path(__file__).resolve().parents[1] / "configs" / "data"
SYSTEM = "Answer with the final number in \\boxed{}."
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class ArithStandIn(Task):
    name = "arith"

    def __init__(self) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(os.environ.get("ARITH_MODEL", "/work/models/smollm2-135m"))

    def _render(self, question: str) -> str:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _rows(self, name: str) -> list[dict[str, str]]:
        return [json.loads(line) for line in (DATA / name).read_text().splitlines()]

    def prompts(self, seed: int) -> Iterator[Prompt]:
        # seed 1_000_003 (eval.seed's default) = the held-out eval file, in order; else the train file, shuffled.
        if seed == 1_000_003:
            rows = self._rows("arith_eval.jsonl")
        else:
            rows = self._rows("arith_train.jsonl")
            random.Random(seed).shuffle(rows)
        i = 0
        while True:
            for r in rows:
                yield Prompt(prompt_id=i, text=self._render(r["prompt"]), answer=r["answer"], data_source=r["data_source"])
                i += 1

    def reward(self, sample: Sample) -> float:
        boxed = re.findall(r"\\boxed\{([^}]*)\}", sample.completion)
        found = boxed[-1:] or _NUMBER.findall(sample.completion)[-1:]
        return 1.0 if found and found[0].strip() == sample.prompt.answer else 0.0


def make_task() -> Task:
    return ArithStandIn()
