"""learner.lora on the real preset (smollm2-135m, fp32) through the whole system: adapter-only syncs
with max_lag 2, where every engine's adapter (read back from vLLM's LoRA slot) equals the learner's
after each sync; a delivery into the wrong adapter slot stops the sync loudly; the run resumes from
its PEFT-format checkpoint; the merged export scores like the LoRA-served adapter.

One Ray cluster for the module; two controllers (the run, then its resume)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import msgspec
import pytest
import ray
import torch

from async_rl.config import WandbConfig
from async_rl.controller import Controller
from async_rl.errors import RunError
from async_rl.learner.base import Probe, checkpoint_adapter_dir
from async_rl.learner.lora import load_adapter, served_tensors
from async_rl.metrics import MetricsSink
from async_rl.weight_sync.checksum import ParamChecksum, checksum_of
from tests.integration._chat_task import MAX_TOKENS_ENV, MODEL_ENV, STOP
from tests.integration._engine_env import FAST_ENGINE_ENV
from tests.integration._lora_strike import deliver_into_another_slot
from tests.integration._real_run import REPO, read_jsonl, real_config, smollm2_dir

pytestmark = pytest.mark.integration

STEPS, RESUMED_STEPS = 4, 4  # max_lag 2: the 4th batch cannot come from version 0 alone
PROMPTS, GROUP, MAX_TOKENS = 2, 4, 24
RANK = 8


class LoraRun(msgspec.Struct):
    records: list[dict]
    after_sync: list[tuple[ParamChecksum, list[ParamChecksum]]]  # learner's and engines' served adapter, per step
    wrong_slot_error: str
    resumed_records: list[dict]
    resumed_learner: ParamChecksum | None  # the learner's adapter right after the resume
    resumed_final: tuple[ParamChecksum, list[ParamChecksum]]  # after the resumed run's last sync
    checkpoint_learner: ParamChecksum  # the adapter the checkpoint holds (as served)
    merged_vs_learner: float  # mean |merged HF model - HF with the checkpoint's adapter (PEFT)| log-prob
    merged_vs_served: float  # mean |merged HF model - vLLM with the adapter| log-prob
    base_vs_served: float  # the same against the base model: the adapter matters
    adapter_bytes: int


def cfg_for(run_dir: Path, steps: int):
    return real_config(
        [
            "task.name=tests.integration._chat_task:make_task",
            f"train.total_steps={steps}",
            "train.max_lag=2",
            f"train.prompts_per_step={PROMPTS}",
            "train.checkpoint_every=2",
            "train.mismatch_probe_samples=4",
            f"generators.group_size={GROUP}",
            f"generators.max_tokens={MAX_TOKENS}",
            "generators.max_model_len=128",
            "generators.max_inflight_prompts=4",
            f"generators.stop=[{json.dumps(STOP)}]",
            "learner.lr=1e-3",  # LoRA: a larger step, so that the adapter moves visibly in 3 steps
            "learner.lora.enabled=true",
            f"learner.lora.rank={RANK}",
            f"logging.run_dir={run_dir}",
        ]
    )


def make_controller(cfg, run_dir: Path, resume_from: Path | None = None) -> tuple[Controller, MetricsSink]:
    from async_rl.cluster.placement import plan_placement

    sink = MetricsSink(run_dir, WandbConfig(mode="disabled"), {}, cfg.train.total_steps, stream=io.StringIO())
    return Controller(cfg, Path(smollm2_dir()), run_dir, plan_placement(cfg), resume_from=resume_from), sink


def served(controller: Controller) -> tuple[ParamChecksum, list[ParamChecksum]]:
    learner, engines = controller.checksums()
    return learner, list(engines.values())


def mean_abs(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def hf_logprobs(model_dir: str, probe: Probe, adapter_of: Path | None = None) -> list[list[float]]:
    """HF log-probs at the probe's positions; with `adapter_of` (a checkpoint), its adapter on (PEFT)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_of is not None:
        model = PeftModel.from_pretrained(model, str(checkpoint_adapter_dir(adapter_of)))
    out = []
    with torch.no_grad():
        for ids, positions in zip(probe.token_ids, probe.positions, strict=True):
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
            out.append([float(lp[p - 1, ids[p]]) for p in positions])
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> LoraRun:
    from async_rl.export_merged import export_merged

    model_dir = smollm2_dir()
    env = {MODEL_ENV: model_dir, MAX_TOKENS_ENV: str(MAX_TOKENS)}
    os.environ.update(env)
    run_dir = tmp_path_factory.mktemp("lora_run")
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=200 << 20, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO), **FAST_ENGINE_ENV, **env}})
    try:
        controller, sink = make_controller(cfg_for(run_dir, STEPS), run_dir)
        after_sync = []
        try:
            controller.run(sink, lambda step: after_sync.append(served(controller)))
            adapter_bytes = ray.get(controller.learner.actors[0].weight_manifest.remote()).total_bytes
            # A delivery into the wrong slot: the next sync must refuse to go on.
            ray.get(controller.generators.actors[0].__ray_call__.remote(deliver_into_another_slot))
            try:
                controller.runtime.sync_weights(controller.version)
                wrong_slot_error = ""
            except RunError as exc:
                wrong_slot_error = str(exc)
        finally:
            controller.shutdown()
            sink.close()
        records = read_jsonl(run_dir / "metrics.jsonl")
        ckpt = run_dir / "checkpoints" / "step_2"
        tensors, config = load_adapter(checkpoint_adapter_dir(ckpt))
        checkpoint_learner = checksum_of(served_tensors(tensors, config))

        # The run stopped after step 4; resume it from step 2's adapter checkpoint and go on to step 4.
        resumed_dir = tmp_path_factory.mktemp("lora_resumed")
        controller, sink = make_controller(cfg_for(resumed_dir, RESUMED_STEPS), resumed_dir, resume_from=ckpt)
        try:
            controller.run(sink)
            resumed_learner = controller.resumed_checksum
            final = served(controller)
            # The last step's checkpoint, merged, against vLLM serving that same adapter (version 4).
            merged = export_merged(resumed_dir / "checkpoints" / f"step_{RESUMED_STEPS}", resumed_dir / "merged")
            # The learner's own log-probs (adapter on, version 4) on samples of the last batch.
            probe = controller.learner.call(lambda a: a.probe_logprobs.remote(4))[0]
            merged_lps = hf_logprobs(str(merged), probe)
            # The same HF forward with the checkpoint's adapter on (the learner's own probe values come
            # from its packed, chunked scoring path, ~1e-5 from a plain forward: too coarse here).
            adapter_lps = hf_logprobs(model_dir, probe, resumed_dir / "checkpoints" / f"step_{RESUMED_STEPS}")
            merged_vs_learner = mean_abs(sum(merged_lps, []), sum(adapter_lps, []))
            engine = controller.generators.actors[0]
            merged_vs_served = ray.get(engine.score.remote(Probe(probe.token_ids, probe.positions, merged_lps)))
            base_lps = hf_logprobs(model_dir, probe)
            base_vs_served = ray.get(engine.score.remote(Probe(probe.token_ids, probe.positions, base_lps)))
        finally:
            controller.shutdown()
            sink.close()
        resumed_records = read_jsonl(resumed_dir / "metrics.jsonl")
    finally:
        ray.shutdown()
    return LoraRun(
        records=records,
        after_sync=after_sync,
        wrong_slot_error=wrong_slot_error,
        resumed_records=resumed_records,
        resumed_learner=resumed_learner,
        resumed_final=final,
        checkpoint_learner=checkpoint_learner,
        merged_vs_learner=merged_vs_learner,
        merged_vs_served=merged_vs_served,
        base_vs_served=base_vs_served,
        adapter_bytes=adapter_bytes,
    )


def test_every_engine_serves_the_learners_adapter_after_each_sync(run):
    assert [r["version"] for r in run.records] == list(range(1, STEPS + 1))
    assert len(run.after_sync) == STEPS
    previous = None
    for learner, engines in run.after_sync:
        assert engines and all(e.close_to(learner) for e in engines), (learner, engines)
        assert learner.count > 0 and (previous is None or not learner.close_to(previous))  # it trained
        previous = learner


def test_samples_carry_adapter_versions_within_max_lag(run):
    for r in run.records:
        assert r["lag_max"] <= 2 and r["generator_version"] == r["version"]  # synced every step
    # a batch's mean sample version is its step minus its mean lag: later batches hold samples that
    # trained adapters (versions >= 1) generated, and none older than max_lag allows
    assert any(r["step"] - r["lag_mean"] > 0 for r in run.records)
    assert all(r["step"] - r["lag_max"] >= max(0, r["step"] - 2) for r in run.records)
    assert all(r["accounting_balanced"] for r in run.records)


def test_a_sync_is_adapter_sized(run):
    full = (Path(smollm2_dir()) / "model.safetensors").stat().st_size  # every weight, fp32
    print(f"adapter update {run.adapter_bytes} bytes, full model {full} bytes")
    assert 0 < run.adapter_bytes < 0.05 * full


def test_delivery_into_the_wrong_slot_stops_the_sync_in_one_line(run):
    assert run.wrong_slot_error and "\n" not in run.wrong_slot_error
    assert "LoRA adapter" in run.wrong_slot_error, run.wrong_slot_error


def test_resume_continues_from_the_adapter_checkpoint(run):
    # (close_to: the same values, summed in another order)
    assert run.resumed_learner is not None and run.resumed_learner.close_to(run.checkpoint_learner)
    assert [r["version"] for r in run.resumed_records] == [3, 4]
    learner, engines = run.resumed_final
    assert engines and all(e.close_to(learner) for e in engines)


def test_merged_export_scores_like_the_adapter(run):
    print(f"merged vs learner {run.merged_vs_learner:.2e}, merged vs vLLM+adapter {run.merged_vs_served:.2e}, "
          f"base vs vLLM+adapter {run.base_vs_served:.2e}")
    assert run.merged_vs_learner < 1e-5  # the merge itself: HF against HF with the adapter (PEFT)
    # against vLLM serving the adapter: vLLM's own fp32 gap to HF (~1e-5 here, the mismatch metric)
    assert run.merged_vs_served < 1e-4
    assert run.base_vs_served > 100 * run.merged_vs_learner  # the adapter matters on these tokens


def test_vllm_and_learner_logprobs_agree_with_the_adapter(run):
    mismatch = [r["logprob_mismatch"] for r in run.records + run.resumed_records]
    print("mismatch after each sync:", [f"{m:.1e}" for m in mismatch], "sync s:", [r["sync_s"] for r in run.records])
    assert all(m is not None and m < 1e-4 for m in mismatch), mismatch
