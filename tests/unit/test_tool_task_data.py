"""The committed tool-task prompts (configs/data/tools_*.jsonl, benchmarks/make_tool_data.py) are
right: answers match the questions, the worked examples show what the environment really answers,
and no eval question is trained on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from async_rl.config import DataConfig
from async_rl.data import row_to_prompt
from async_rl.envs.tool_calls import parse_turn
from async_rl.envs.tools import Calculator

DATA = Path(__file__).resolve().parents[2] / "configs" / "data"
KINDS = {
    "mul": lambda n: n[0] * n[1],
    "mul_add": lambda n: n[0] * n[1] + n[2],
    "mul_sub": lambda n: n[0] * n[1] - n[2],
    "two_mul": lambda n: n[0] * n[1] + n[2] * n[3],
}


def rows(split: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / f"tools_{split}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("split", ["train", "eval"])
def test_answers_match_the_questions(split):
    data = rows(split)
    assert len(data) == {"train": 4000, "eval": 96}[split]
    for i, row in enumerate(data):
        question = row["prompt"][-1]["content"]
        numbers = [int(x) for x in re.findall(r"\d+", question)]
        assert int(row["answer"]) == KINDS[row["data_source"]](numbers), f"row {i}: {question}"
        prompt = row_to_prompt(row, i, "tools", DataConfig(), f"row {i}")
        assert prompt.messages[-1].role == "user" and prompt.answer == row["answer"]


def test_eval_questions_are_not_in_train():
    train = {r["prompt"][-1]["content"] for r in rows("train")}
    assert not any(r["prompt"][-1]["content"] in train for r in rows("eval"))


def test_worked_examples_show_what_the_calculator_answers():
    """Each example's tool message is exactly what ToolEnvironment would send for its call, and
    its final answer is that result: the model is shown a transcript the environment can produce."""
    shots = rows("eval")[0]["prompt"][:-1]
    assert [m["role"] for m in shots] == ["user", "assistant", "tool", "assistant"] * 2
    for i in range(0, len(shots), 4):
        call = parse_turn(shots[i + 1]["content"], "tag", {"calculator"})
        assert len(call.calls) == 1 and not call.errors
        result = Calculator().run(call.calls[0].arguments)
        assert result.outcome == "ok"
        assert shots[i + 2]["content"] == f"calculator: {result.text}"
        assert shots[i + 3]["content"] == f"The answer is \\boxed{{{result.text}}}."
