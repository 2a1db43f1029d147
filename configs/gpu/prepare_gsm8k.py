"""GSM8K in verl's layout, for the GPU recipes: ~/data/gsm8k/{train,test}.parquet.

    python configs/gpu/prepare_gsm8k.py [--out ~/data/gsm8k]

Needs network access to the Hugging Face Hub (`openai/gsm8k`, config `main`). Each row is what verl's
examples/data_preprocess/gsm8k.py writes: `prompt` (a one-message chat), `reward_model.ground_truth`
(the number after '####' in the reference solution), `data_source`, `ability` and `extra_info`; the
recipes read it with data.answer_key=reward_model.ground_truth and task.reward=math. A file made by
verl's own script works the same.
"""

from __future__ import annotations

import argparse
from pathlib import Path

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def to_verl_row(row: dict, split: str, index: int) -> dict:
    answer = row["answer"].split("####")[-1].strip().replace(",", "")
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{row['question']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="~/data/gsm8k")
    out = Path(ap.parse_args().out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    from datasets import Dataset, load_dataset

    for split in ("train", "test"):
        rows = load_dataset("openai/gsm8k", "main", split=split)
        Dataset.from_list([to_verl_row(r, split, i) for i, r in enumerate(rows)]).to_parquet(out / f"{split}.parquet")
        print(f"{out / f'{split}.parquet'}: {len(rows)} rows")


if __name__ == "__main__":
    main()
