"""Write the tool-use prompt files of configs/smollm2_tools.yaml (deterministic; rerun to recreate).

    python benchmarks/make_tool_data.py            # configs/data/tools_{train,eval}.jsonl

Arithmetic word problems whose numbers make mental arithmetic hard for a 135M model (three-digit
times two-digit products, two-step sums and differences of products), so that calling the
calculator is what gets them right. Rows in the verl-style layout of configs/data/arith_*.jsonl:
`prompt` (the question as text; the chat template, `data.system_prompt` and the environment's tool
instructions are applied when the files are loaded), `answer` (the integer result, checked by the
`math` reward), `data_source` (the problem kind, so eval pass@1 is reported per kind: `mul` a*b,
`mul_add` a*b+c, `mul_sub` a*b-c, `two_mul` a*b+c*d). The eval file holds no question of the train
file.

By default `prompt` is a chat: two worked examples in the tag tool format (a question, the
assistant's calculator call, the tool's result, the boxed answer), then the question. The probe of
the starting model (benchmarks/results/tools_probe.md) found that SmolLM2-135M makes almost no
calls from instructions alone (<= 3% of episodes), 8% with one worked example and 72% with these
two. `--no-examples` writes the question alone as text.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_arith_data import write_splits  # noqa: E402 - after the path insert that makes it importable

# (container, item) pairs that keep the stories readable.
ITEMS = [("boxes", "pencils"), ("crates", "apples"), ("shelves", "books"), ("buses", "passengers"),
         ("rows", "seats"), ("packs", "cards"), ("trays", "cookies"), ("bags", "marbles")]


def question(rng: random.Random) -> tuple[str, int, str]:
    kind = rng.choice(["mul", "mul_add", "mul_sub", "two_mul"])
    group, item = rng.choice(ITEMS)
    a, b = rng.randint(101, 999), rng.randint(11, 99)
    if kind == "mul":
        return f"There are {a} {group} with {b} {item} in each. How many {item} are there in total?", a * b, kind
    if kind == "mul_add":
        c = rng.randint(101, 999)
        text = f"There are {a} {group} with {b} {item} in each, and {c} loose {item}. How many {item} are there in total?"
        return text, a * b + c, kind
    if kind == "mul_sub":
        c = rng.randint(101, 999)
        text = f"There are {a} {group} with {b} {item} in each. Then {c} {item} are taken away. How many {item} are left?"
        return text, a * b - c, kind
    c, d = rng.randint(101, 999), rng.randint(11, 99)
    text = (
        f"A shop has {a} {group} with {b} {item} in each and {c} {group} with {d} {item} in each. "
        f"How many {item} does it have in total?"
    )
    return text, a * b + c * d, kind


def _example(question_text: str, expression: str, result: int) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": question_text},
        {"role": "assistant", "content": f'<tool name="calculator">{expression}</tool>'},
        {"role": "tool", "content": f"calculator: {result}"},
        {"role": "assistant", "content": f"The answer is \\boxed{{{result}}}."},
    ]


# Worked examples put before every question (one one-step, one two-step problem; not in the data:
# their numbers are fixed here). Their tool message is what ToolEnvironment answers for that call.
WORKED_EXAMPLES = _example(
    "There are 123 boxes with 45 pens in each. How many pens are there in total?", "123*45", 123 * 45
) + _example(
    "A shop has 214 bags with 36 marbles in each and 158 bags with 27 marbles in each. "
    "How many marbles does it have in total?",
    "214*36+158*27",
    214 * 36 + 158 * 27,
)


def tool_row(rng: random.Random) -> dict[str, str]:
    text, answer, kind = question(rng)
    return {"prompt": text, "answer": str(answer), "data_source": kind}


def chat_row(rng: random.Random) -> dict:
    """`tool_row` with the worked examples before the question, as a chat."""
    r = tool_row(rng)
    return {**r, "prompt": [*WORKED_EXAMPLES, {"role": "user", "content": r["prompt"]}]}


def main() -> None:
    write_splits(
        __doc__,
        "tools",
        lambda args: tool_row if args.no_examples else chat_row,
        lambda ap: ap.add_argument("--no-examples", action="store_true", help="the question alone, as text"),
    )


if __name__ == "__main__":
    main()
