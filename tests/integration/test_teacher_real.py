"""The distillation teacher served beside the pool, with real parts on one Ray for the module.

1. A teacher replica (smollm2-135m on a vLLM engine of its own) scores a group through the engines'
   scorer: its log-prob of every completion token equals HF's log-softmax of the same model on the same
   tokens (fp32), the environment's token of a multi-turn sample zeroed.
2. A short on-policy distillation run (the tiny student, its wider sibling as the teacher: one
   tokenizer): every trained sample carries the teacher's scores; after step 2 the teacher's vLLM engine
   core is killed, the supervisor restarts the replica at a new address, the groups that waited for it
   are scored by the new one, and nothing goes unscored or unaccounted.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest
import torch
from test_elastic import events
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_rl.config import load_config
from async_rl.protocol import REWARD_OK, TrajectoryGroup
from async_rl.teacher.scorer import TeacherScorer
from async_rl.teacher.setup import teacher_pool
from tests.integration._real_run import smollm2_dir
from tests.integration.test_training_run import check_common, run_short

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_cluster")]  # one Ray for the module

TEACHER = ["teacher.device=cpu", "teacher.kv_cache_gib=0.25", "teacher.timeout_s=30", "teacher.max_wait_s=240"]


def hf_completion_logprobs(model_dir: str, prompt: list[int], completion: list[int]) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
    return [float(logp[0, len(prompt) + j - 1, t]) for j, t in enumerate(completion)]


def test_teacher_scores_equal_hf_logprobs(model_cache):
    folder = smollm2_dir()
    cfg = load_config(None, [f"model.cache_dir={model_cache}", "algorithm.name=opd", f"teacher.model={folder}", *TEACHER])
    tok = AutoTokenizer.from_pretrained(folder)
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 17 + 25?"}], add_generation_prompt=True, tokenize=False)
    prompt = tok(chat, add_special_tokens=False)["input_ids"]
    texts = ["17 + 25 = 42. The answer is 42.", "Let me think: 17 plus 25 makes 43", "42"]
    completions = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    mask = np.ones(len(completions[1]), np.uint8)
    mask[2] = 0  # as if an environment had written it
    group = TrajectoryGroup(
        prompt_id=0, engine_id=0, prompt_tokens=np.array(prompt, np.int32),
        completions=[np.array(c, np.int32) for c in completions],
        logprobs=[np.zeros(len(c), np.float32) for c in completions],
        rewards=[0.0] * 3, version_first=[0] * 3, version_last=[0] * 3, reward_status=[REWARD_OK] * 3,
        loss_masks=[None, mask, None],
    )
    pool = teacher_pool(cfg, 512)
    pool.start()
    try:
        async def score():
            scorer = TeacherScorer(pool.endpoints(), cfg.teacher.timeout_s, cfg.teacher.max_wait_s)
            try:
                return await scorer.score(group), scorer.counts
            finally:
                await scorer.close()

        scored, counts = asyncio.run(score())
    finally:
        pool.shutdown()
    assert counts.groups == 1 and counts.unscored == 0 and counts.failures == 0
    worst = 0.0
    for i, c in enumerate(completions):
        want = np.array(hf_completion_logprobs(folder, prompt, c), np.float32)
        want = np.where(group.loss_mask(i) == 1, want, 0.0)
        got = scored.teacher_logprobs[i]
        worst = max(worst, float(np.abs(got - want).max()))
        np.testing.assert_allclose(got, want, atol=2e-3, rtol=0)
    assert scored.teacher_logprobs[1][2] == 0.0
    # a real model's log-probs are far from uniform: a position off by one would miss by far more
    assert min(float(x.min()) for x in scored.teacher_logprobs) < -3
    print(f"teacher vs HF fp32: max |diff| {worst:.2e} over {sum(len(c) for c in completions)} tokens")


STEPS = 6
KILL_AFTER = 1  # the teacher's engine core dies after step 2 (0-based step 1)


def _kill_teacher(controller, step: int, seen: dict) -> None:
    pool = controller.runtime.teacher
    if step == STEPS - 1:  # before the run's end stops the replica
        seen["last_stats"], seen["after"] = pool.stats(), pool.endpoints()
    if step != KILL_AFTER:
        return
    seen["before"] = pool.endpoints()
    seen["killed_at"] = time.time()
    for pid in pool.pids()[0].engine_core:
        os.kill(pid, signal.SIGKILL)


def test_a_distillation_run_survives_a_killed_teacher_and_loses_nothing(tmp_path, model_cache):
    seen: dict = {}
    cfg, summary, learner_ck, engine_cks, final, records = run_short(
        tmp_path, model_cache,
        [f"train.total_steps={STEPS}", "train.prompts_per_step=2", "generators.group_size=2", "train.max_lag=1",
         "train.checkpoint_at_end=false", "algorithm.name=opd", "algorithm.distill_rewards=grpo",
         "teacher.model=tiny-qwen2-wide", *TEACHER],
        between=lambda controller, step: _kill_teacher(controller, step, seen),
    )
    assert [r["step"] for r in records] == list(range(STEPS))
    print("teacher per step (kl, tokens, tok/s, share, missing, unscored, failures, timeouts, restarts):",
          [(round(r["kl_teacher"], 3), r["teacher_tokens"], round(r["teacher_tokens_per_s"]), round(r["teacher_share"], 2),
            r["teacher_missing"], r["teacher_unscored"], r["teacher_failures"], r["teacher_timeouts"],
            r["teacher_restarts"]) for r in records])
    recovered = [e for e in events(tmp_path) if e["at"] >= seen["killed_at"] and "teacher replica(s) [0] died" in e["reason"]]
    assert recovered, "the supervisor never restarted the killed teacher"
    assert seen["before"][0].base_url != seen["after"][0].base_url  # a new replica at a new address
    (restarted,) = seen["last_stats"]
    assert restarted.requests > 0 and restarted.refused == 0  # the new replica scored the later groups
    last = records[-1]
    assert last["teacher_restarts"] == 1
    # nothing lost: every trained sample had the teacher's scores, none went unscored, the accounts add up
    assert all(r["teacher_missing"] == 0 for r in records)
    assert last["teacher_unscored"] == 0
    assert all(r["kl_teacher"] != 0 for r in records)  # a random teacher and student disagree
    # the accounts add up (groups that waited out the restart may arrive too late for max_lag: dropped stale)
    check_common(cfg, summary, learner_ck, engine_cks, final, records, late_groups=True)
    engines = [e.teacher for e in summary.engines]
    assert sum(c.samples for c in engines) >= STEPS * cfg.train.prompts_per_step * cfg.generators.group_size
