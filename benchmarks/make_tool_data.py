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


def tool_row(rng: random.Random) -> dict[str, str]:
    text, answer, kind = question(rng)
    return {"prompt": text, "answer": str(answer), "data_source": kind}


def main() -> None:
    write_splits(__doc__, "tools", tool_row)


if __name__ == "__main__":
    main()
