"""Write the arithmetic prompt files of configs/smollm2_arith.yaml (deterministic; rerun to recreate).

    python benchmarks/make_arith_data.py            # configs/data/arith_{train,eval}.jsonl

Rows in the verl-style layout the data loader reads: `prompt` (the question as text; the chat
template and `data.system_prompt` are applied when the files are loaded), `answer` (the integer
result, checked by the `math` reward), `data_source` (the operation, so eval pass@1 is reported per
operation). Questions: two-digit addition and subtraction, one-digit times two-digit
multiplication. The eval file holds no question of the train file.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "configs" / "data"
SOURCES = {"+": "add", "-": "sub", "*": "mul"}


def question(rng: random.Random) -> tuple[str, int, str]:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, 9), rng.randint(10, 99)
    else:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
    answer = a + b if op == "+" else a - b if op == "-" else a * b
    return f"{a} {op} {b}", answer, SOURCES[op]


def unique_rows(
    rng: random.Random, count: int, exclude: set[str], make_row: Callable[[random.Random], dict]
) -> list[dict]:
    """`count` rows from `make_row`, no two with the same prompt, none with a prompt in `exclude`
    (prompts compared as JSON: a prompt may be text or a list of chat messages)."""
    out, seen = [], set(exclude)
    while len(out) < count:
        row = make_row(rng)
        key = json.dumps(row["prompt"])
        if key in seen:
            continue
        seen.add(key)
        out.append(row)
    return out


def arith_row(rng: random.Random) -> dict[str, str]:
    expr, answer, source = question(rng)
    return {"prompt": f"What is {expr}?", "answer": str(answer), "data_source": source}


def write_splits(
    doc: str,
    prefix: str,
    row_maker: Callable[[argparse.Namespace], Callable[[random.Random], dict]],
    add_arguments: Callable[[argparse.ArgumentParser], object] | None = None,
) -> None:
    """The command line shared by the data scripts: held-out eval rows first, then train rows that
    repeat none of them, written to OUT/{prefix}_{train,eval}.jsonl. `row_maker(args)` gives the
    row function; `add_arguments` adds a script's own options."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--train", type=int, default=4000, help="training rows")
    ap.add_argument("--eval", type=int, default=96, help="held-out eval rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    if add_arguments is not None:
        add_arguments(ap)
    args = ap.parse_args()
    make_row = row_maker(args)
    rng = random.Random(args.seed)
    eval_rows = unique_rows(rng, args.eval, set(), make_row)
    train_rows = unique_rows(rng, args.train, {json.dumps(r["prompt"]) for r in eval_rows}, make_row)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, data in ((f"{prefix}_train.jsonl", train_rows), (f"{prefix}_eval.jsonl", eval_rows)):
        (args.out / name).write_text("".join(json.dumps(r) + "\n" for r in data))
        print(f"{args.out / name}: {len(data)} rows")


def main() -> None:
    write_splits(__doc__, "arith", lambda args: arith_row)


if __name__ == "__main__":
    main()
