"""Multi-turn episodes on the real preset (smollm2-135m): the guess-the-number game, a few steps, one
engine for the module. Each turn is a vLLM request from the running token ids; weight updates land
between and inside turns (pause_mode=abort: a cut turn is resubmitted and finished on the new weights).
The second step's prompts hold their first environment turn until the first sync happened
(`_gated_guess.py`), so their later turns run on newer weights than their first.
"""

from __future__ import annotations

import pytest

from async_rl.learner.base import Probe
from tests.integration._gated_guess import MARKER_ENV
from tests.integration._real_run import read_jsonl, real_config, real_controller, smollm2_dir

pytestmark = pytest.mark.integration

STEPS = 3  # the gated groups (prompt ids 2-3, leased for the second step) train at step 1 or 2
PROMPTS, GROUP = 2, 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("multiturn_run")
    marker = run_dir / "first_sync_done"  # written after step 0's sync: the gated episodes go on then
    cfg = real_config(
        [
            "task.name=async_rl.envs.guess:GuessNumberTask",
            "env.name=tests.integration._gated_guess:make_env",
            "env.max_turns=3",  # two turns show what is asserted; SmolLM2 seldom guesses right, so most run to the limit
            f"train.total_steps={STEPS}",
            "train.max_lag=2",  # the gated groups (held until the first sync) are not dropped as stale
            f"train.prompts_per_step={PROMPTS}",
            f"train.mismatch_probe_samples={PROMPTS * GROUP}",
            f"generators.group_size={GROUP}",
            "generators.max_tokens=40",
            "generators.max_model_len=320",
            "generators.max_inflight_prompts=4",
            "generators.pause_mode=abort",
            "learner.lr=1e-5",
        ]
    )
    probes: list[Probe] = []
    with real_controller(cfg, run_dir, {MARKER_ENV: str(marker)}) as (controller, sink):

        def after_step(step: int) -> None:
            marker.touch()
            print(f"after step {step}: engine versions {[e.version for e in controller.generators.stats()]}")
            probes.append(controller.learner.call(lambda a: a.probe_logprobs.remote(PROMPTS * GROUP))[0])

        controller.run(sink, after_step)
        final = controller.shutdown()
    records = read_jsonl(run_dir / "metrics.jsonl")
    for r in records:  # shown with -s: the numbers behind the assertions
        print(
            f"step {r['step']}: mismatch {r['logprob_mismatch']:.2e} turns {r['turns_mean']:.2f} max {r['turns_max']} "
            f"env share {r['env_token_share']:.2f} len p50 {r['completion_len_p50']:.0f} p90 {r['completion_len_p90']:.0f} "
            f"max {r['completion_len_max']} across updates {r['samples_across_updates']} lag max {r['lag_max']} "
            f"reward {r['reward_mean']:.3f}"
        )
    gate_log = run_dir / "gate.log"
    print(gate_log.read_text() if gate_log.exists() else "no gated episode reached its first environment turn")
    from transformers import AutoTokenizer

    return records, probes, final, AutoTokenizer.from_pretrained(smollm2_dir())


def test_vllm_and_learner_agree_on_the_model_tokens(run):
    records, _, final, _ = run
    mismatch = [r["logprob_mismatch"] for r in records]
    assert len(mismatch) == STEPS and all(m is not None and m < 1e-3 for m in mismatch), mismatch
    assert not final.rejected_frames and final.accounts.balanced()


def test_episodes_are_multi_turn_and_environment_tokens_carry_no_loss(run):
    records, probes, _, tok = run
    assert max(r["turns_max"] for r in records) >= 2 and any(r["env_token_share"] > 0 for r in records)
    env_turns = 0
    for probe in probes:  # the trained batch: its tokens and the positions its loss mask kept
        for ids, positions in zip(probe.token_ids, probe.positions, strict=True):
            kept = set(positions)
            start = positions[0]
            env = [t for i, t in enumerate(ids) if i >= start and i not in kept]
            if env:
                env_turns += 1
                text = tok.decode(env)
                # what the loss left out is exactly the game's answers and the next assistant header
                assert "<|im_start|>user" in text and "<|im_start|>assistant" in text, text
                assert any(w in text for w in ("higher", "lower", "Please answer with a number")), text
                assert not any(i in kept for i in range(start, len(ids)) if ids[i] == 1)  # no <|im_start|> trained
    assert env_turns > 0


def test_a_weight_update_inside_an_episode(run):
    records, _, _, _ = run
    # Trained samples whose later turns ran on newer weights than their first turn: the gated ones of
    # steps 1-2 that went on to a second turn (and any other episode a sync landed in).
    assert sum(r["samples_across_updates"] for r in records) > 0, [r["samples_across_updates"] for r in records]
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))
