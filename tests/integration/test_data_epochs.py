"""A run on a data file ends when its epochs are done: the prompt stream runs out, the run stops
after its last full step with exit code 0, and nothing is left in flight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration._engine_env import FAST_ENGINE_ENV
from tests.integration._launch import launch

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")


def test_the_run_stops_when_the_data_epochs_are_done(tmp_path, model_cache):
    data = tmp_path / "four.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{c}:", "answer": c}) + "\n" for c in "abcd"))
    p = launch(
        QUICKSTART, f"model.cache_dir={model_cache}", f"logging.run_dir={tmp_path}", "logging.run_name=epochs",
        "logging.wandb.mode=disabled", f"data.train_files=[{data}]", "data.epochs=2", "train.total_steps=50",
        "train.prompts_per_step=2", "generators.group_size=2", "generators.max_tokens=4",
        "train.mismatch_probe_samples=0", "train.checkpoint_at_end=false", env=FAST_ENGINE_ENV,
    )
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    assert "data: 4 training prompts x 2 epoch(s)" in out
    # 8 prompts (4 rows x 2 epochs) make 4 steps of 2 groups; the fifth can never fill.
    assert "step 5 cannot be filled; stopping after step 4" in out and "done: 4 steps" in out
    records = [json.loads(line) for line in (tmp_path / "epochs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    last = records[-1]
    assert last["trained"] == 4 * 2 * 2 and last["in_flight"] == 0 and last["accounting_balanced"]
    assert last["data_epoch"] * 4 + last["data_index"] == 8
