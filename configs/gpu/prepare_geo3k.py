"""Geometry3K in verl's layout, for the vision-language recipe: ~/data/geo3k/{train,test}.parquet.

    python configs/gpu/prepare_geo3k.py [--out ~/data/geo3k] [--limit N]
    python configs/gpu/prepare_geo3k.py --from-rows rows.jsonl [--out DIR]   # no network: hand-made rows

Needs network access to the Hugging Face Hub (`hiyouga/geometry3k`: 2,101 train, 601 test problems,
one diagram each) unless --from-rows names a JSON-lines file of the Hub's columns (`problem`,
`answer`, `images` as a list of file paths, relative to that file; its rows become the train split,
and the test split too). Each row is what verl's examples/data_preprocess/geo3k.py writes: `prompt`
(a one-message chat: the problem, whose `<image>` marks where its diagram goes, and the instruction),
`images` (a list of {"bytes": encoded file, "path": None}: the datasets library's image cells),
`reward_model.ground_truth` (the answer), `data_source`, `ability` and `extra_info`. The recipe reads it
with data.answer_key=reward_model.ground_truth and task.reward=math. A file made by verl's own script
has the same columns.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

DATA_SOURCE = "hiyouga/geometry3k"
# verl's instruction, word for word, so results compare with its geo3k runs: the reward (math-verify)
# reads the boxed answer; the <think> tags it asks for are not scored.
INSTRUCTION = (
    r"You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    r"The reasoning process MUST BE enclosed within <think> </think> tags. "
    r"The final answer MUST BE put in \boxed{}."
)


def image_cell(image: Any) -> dict[str, bytes | None]:
    """One image as the datasets library stores it in parquet: {"bytes": the encoded file, "path": None}.
    A cell that holds bytes already keeps them (the file as published); a PIL image is saved as PNG
    (lossless: the pixels the Hub's file decodes to)."""
    if isinstance(image, dict) and image.get("bytes"):
        return {"bytes": bytes(image["bytes"]), "path": None}
    if isinstance(image, bytes | bytearray):
        return {"bytes": bytes(image), "path": None}
    if isinstance(image, dict) and image.get("path"):
        return {"bytes": Path(image["path"]).read_bytes(), "path": None}
    out = io.BytesIO()
    image.save(out, format="PNG")  # a PIL image (the datasets library's decoded Image feature)
    return {"bytes": out.getvalue(), "path": None}


def to_row(example: dict[str, Any], index: int, split: str) -> dict[str, Any]:
    """One Hub example ({problem, answer, images}) -> one row in verl's geo3k layout."""
    problem, answer = example["problem"], example["answer"]
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{problem} {INSTRUCTION}"}],
        "images": [image_cell(im) for im in example["images"]],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": problem},
    }


def rows_from_file(path: Path) -> list[dict[str, Any]]:
    """Hub-shaped examples from a JSON-lines file; image paths are relative to the file."""
    examples = []
    for line in path.read_text().splitlines():
        if line.strip():
            example = json.loads(line)
            example["images"] = [{"path": str(path.parent / p)} for p in example["images"]]
            examples.append(example)
    return examples


def write_split(examples: Any, split: str, out: Path, limit: int) -> Path:
    from datasets import Dataset

    rows = []
    for i, example in enumerate(examples):
        if limit and i >= limit:
            break
        rows.append(to_row(example, i, split))
    target = out / f"{split}.parquet"
    Dataset.from_list(rows).to_parquet(target)
    print(f"{target}: {len(rows)} rows")
    return target


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="~/data/geo3k")
    ap.add_argument("--limit", type=int, default=0, help="at most this many rows per split (0: all)")
    ap.add_argument("--from-rows", default="", metavar="FILE.jsonl", help="Hub-shaped rows from a local file, no network")
    args = ap.parse_args(argv)
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    if args.from_rows:
        examples = rows_from_file(Path(args.from_rows).expanduser())
        for split in ("train", "test"):
            write_split(examples, split, out, args.limit)
        return
    from datasets import load_dataset

    for split in ("train", "test"):
        write_split(load_dataset(DATA_SOURCE, split=split), split, out, args.limit)


if __name__ == "__main__":
    main()
