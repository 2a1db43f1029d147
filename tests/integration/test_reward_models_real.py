"""Reward models served beside the pool, with real parts on one Ray for the module.

1. A short run of the tiny policy whose reward is an LLM judge (smollm2-135m) on a vLLM engine of its own:
   every sample is scored by the judge through its OpenAI-compatible endpoint (the reward workers' calls
   counted in the step metrics); after step 2 the judge's vLLM engine core is killed with every CPU core
   kept busy, the run's watcher (or its health check, whichever comes first) finds the replica dead and
   its supervisor restarts it (both timed and printed, not bounded: docs/faults.md), every engine is pointed
   at its new address, and later samples are scored by the new engine. The restarted replica is killed
   while it starts: it is started again and the failed start counted.
2. A tiny random sequence-classification model (built here, SmolLM2's tokenizer) in a reward-model actor
   scores a batch from real reward workers, equal to the model's own outputs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
import ray
from _load import start_burners
from test_elastic import events
from test_faults import burn_until_found, found_and_acted

from async_rl.config import load_config
from async_rl.generator.rewards import RewardRunner
from async_rl.protocol import REWARD_OK, Prompt, Sample
from async_rl.reward_models.classifier import ClassifierModel, ClassifyInput
from async_rl.reward_models.pool import RewardModelPool
from async_rl.reward_models.setup import reward_model_pool
from tests.integration._real_run import smollm2_dir
from tests.integration.test_training_run import run_short
from tests.unit._classifier import build_tiny_classifier

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]  # one Ray for the module

STEPS = 6  # the samples of steps 5 and 6 are leased after the restart: the new judge scores them
KILL_AFTER = 1  # the judge dies after step 2 (0-based step 1)
JUDGE = [
    "task.judge.device=cpu",
    "task.judge.kv_cache_gib=0.25",  # ~5,800 tokens: 11 verdicts of max_model_len at once
    "task.judge.max_model_len=512",
    "task.judge.max_tokens=8",
    "task.judge.timeout_s=30",
    "task.reward_timeout_s=60",
    "task.failure_window=0",
]


def _kill_judge(controller, step: int, seen: dict) -> None:
    """After step KILL_AFTER: SIGKILL the judge's vLLM engine core with every core kept busy until the
    run logs the death; the run itself (its watcher, or its health check) must find it and its supervisor
    restart the replica."""
    pool = controller.runtime.reward_models
    if step == STEPS - 1:  # before the run's end stops the replica
        seen["last_stats"], seen["after"] = pool.stats(), pool.endpoints()
    if step != KILL_AFTER:
        return
    seen["before"] = pool.endpoints()
    procs = start_burners()
    seen["killed_at"] = time.time()
    threading.Thread(target=burn_until_found, args=(seen["run_dir"], seen["killed_at"], procs), daemon=True).start()
    for pid in pool.pids()[0].engine_core:
        os.kill(pid, signal.SIGKILL)


def test_a_judge_scores_the_run_and_is_restarted_after_its_engine_dies(tmp_path, model_cache, monkeypatch):
    # the judge: the real preset's folder (converted once per machine, shared with the other real-model tests)
    judge = f"task.reward=judge:{smollm2_dir()}"
    seen: dict = {"run_dir": tmp_path}
    # A second fault during the recovery: the restarted replica is killed while it starts; it is started
    # again (generators.start_attempts), and the failed start is counted.
    real_restart = RewardModelPool.restart

    def restart(pool, dead):
        if "struck" not in seen:
            old = pool.handles[dead[0]].actor

            def strike():
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    handle = pool.handles.get(dead[0])
                    if handle is not None and handle.actor is not old:
                        time.sleep(2.0)  # into its start (a judge's vLLM takes >10 s to start here)
                        seen["struck"] = time.time()
                        ray.kill(handle.actor, no_restart=True)
                        return
                    time.sleep(0.05)

            threading.Thread(target=strike, daemon=True).start()
        return real_restart(pool, dead)

    monkeypatch.setattr(RewardModelPool, "restart", restart)
    cfg, summary, _, _, _, records = run_short(
        tmp_path, model_cache,
        [f"train.total_steps={STEPS}", "train.prompts_per_step=2", "generators.group_size=2", "train.max_lag=1",
         "train.checkpoint_at_end=false", judge, *JUDGE],
        between=lambda controller, step: _kill_judge(controller, step, seen),
    )
    assert [r["step"] for r in records] == list(range(STEPS))
    # found and acted on by the run itself, every core busy: by the watcher, or by the supervisor's health
    # check when it gets there first (the watcher then says nothing about the replica it restarted), as
    # the kill tests take it. How soon is printed, not asserted: under the whole suite on 2 cores the
    # starved replica answered both only after 12 s once (docs/faults.md); what must hold is below, the
    # new replica judging the later samples.
    found, acted = found_and_acted(events(tmp_path), seen["killed_at"], "reward model 0 ", "judge replica(s) [0]")
    by = "the watcher" if found < acted else "the health check (no watcher event before the recovery)"
    print(f"judge engine core killed: found by {by} after {found:.2f} s, acted on after {acted:.2f} s")
    print("judge counters per step (calls, unparseable, failures, timeouts, restarts):",
          [(r["reward_model_calls"], r["reward_model_unparseable"], r["reward_model_failures"],
            r["reward_model_timeouts"], r["reward_model_restarts"]) for r in records])
    # the replica came back at a new address and the engines call it there
    assert seen["before"][0].base_url != seen["after"][0].base_url
    assert records[-1]["reward_model_restarts"] == 1 and records[KILL_AFTER]["reward_model_restarts"] == 0
    assert "struck" in seen and records[-1]["failed_starts"] == 1 and records[KILL_AFTER]["failed_starts"] == 0

    def ok(r):
        return r["reward_model_calls"] - r["reward_model_unparseable"] - r["reward_model_failures"] - r["reward_model_timeouts"]

    first, at_kill, last = records[0], records[KILL_AFTER], records[-1]
    batch = cfg.train.prompts_per_step * cfg.generators.group_size
    assert first["reward_model_calls"] >= batch  # every trained sample was judged
    assert at_kill["reward_model_failures"] == at_kill["reward_model_timeouts"] == 0  # a healthy judge
    assert last["reward_model_calls"] > at_kill["reward_model_calls"]
    assert ok(last) > ok(at_kill)
    (restarted,) = seen["last_stats"]
    assert restarted.requests > 0 and restarted.refused == 0  # the new engine judged the later samples
    assert last["reward_model_timeouts"] == 0
    # the step metrics are the engines' counters summed
    engines = [e.reward_model for e in summary.engines]
    assert sum(c.calls for c in engines) == last["reward_model_calls"]


def test_a_classifier_scores_a_batch_in_its_actor(tmp_path):
    folder = build_tiny_classifier(tmp_path / "classifier", smollm2_dir(), num_labels=3)
    cfg = load_config(None, [f"task.reward=classifier:{folder}", "task.classifier.device=cpu",
                             "task.classifier.label=2", "task.classifier.transform=softmax",
                             "task.classifier.timeout_s=20", "task.reward_timeout_s=30"])
    pool = reward_model_pool(cfg)
    samples = [Sample(prompt=Prompt(prompt_id=i, text=f"What is {i} + 1?", answer=str(i + 1)),
                      completion=f"The answer is {i + 1 + i % 2}.") for i in range(6)]
    pool.start()
    try:
        async def score():
            runner = RewardRunner(cfg.task, cfg.task.reward_timeout_s, workers=2)
            runner.endpoints = pool.endpoints()
            try:
                return await asyncio.gather(*(runner.score(s) for s in samples)), runner.model_counts
            finally:
                runner.close()

        scored, counts = asyncio.run(score())
        (stats,) = pool.stats()
    finally:
        pool.shutdown()
    c = cfg.task.classifier
    model = ClassifierModel(str(folder), "float32", "cpu", c.input, c.label, c.transform, c.max_length)
    want = model.score([ClassifyInput(s.prompt.text, s.completion) for s in samples])
    assert [st for _, st in scored] == [REWARD_OK] * len(samples)
    assert [v for v, _ in scored] == pytest.approx(want, abs=1e-5)
    assert all(0 < v < 1 for v, _ in scored)  # softmax probabilities of label 2
    assert (counts.calls, counts.ok) == (len(samples), len(samples))
    assert stats.requests == len(samples) and stats.batches <= len(samples)
