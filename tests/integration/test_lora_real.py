"""learner.lora on the real preset (smollm2-135m, fp32) through the whole system: adapter-only syncs
with max_lag 2, where every engine's adapter (read back from vLLM's LoRA slot) equals the learner's
after each sync; a run whose learner is killed (SIGKILL) after a checkpoint resumes from its PEFT-format
adapter checkpoint; a delivery into the wrong adapter slot stops the sync loudly; the merged export,
served by vLLM as a plain model, scores like vLLM serving the adapter. And a short LoRA run of the tiny
Qwen2.5-VL on the colour task (prompts with images): the adapter is on its language model only, vLLM
serves it (the same values read back, log-probs of the multimodal samples agree), the vision tower and
its projector stay as loaded, a resume from its adapter checkpoint serves that adapter, and its merged
export (a VLM folder) served by vLLM scores like the adapter.

One Ray cluster for the SmolLM2 run: two controllers (the killed run, then its resume), then one engine
serving the merged export; a second Ray for the VLM's run (its controller, its resume's, then one engine
serving its merged export)."""

from __future__ import annotations

import io
import json
import os
import signal
import time
from pathlib import Path

import msgspec
import pytest
import ray
import torch

from async_rl.config import WandbConfig
from async_rl.control import checkpoint
from async_rl.control.controller import Controller
from async_rl.control.metrics import MetricsSink
from async_rl.errors import RunError
from async_rl.generator.engine import EngineSettings, GeneratorEngine
from async_rl.learner.base import Probe, checkpoint_adapter_dir
from async_rl.learner.model.lora import load_adapter, served_tensors
from async_rl.weight_sync.checksum import ParamChecksum, checksum_of
from tests.integration._chat_task import MAX_TOKENS_ENV, MODEL_ENV, STOP
from tests.integration._engine_env import FAST_ENGINE_ENV
from tests.integration._lora_strike import base_probe, deliver_into_another_slot
from tests.integration._real_run import REPO, read_jsonl, real_config, real_controller, smollm2_dir

pytestmark = pytest.mark.integration

STEPS = 4  # max_lag 2: the 4th batch cannot come from version 0 alone
KILLED_AFTER = 3  # the first run's learner is SIGKILLed after its 3rd step: its last checkpoint is step 2
PROMPTS, GROUP, MAX_TOKENS = 2, 4, 24
RANK = 8

Served = tuple[ParamChecksum, list[ParamChecksum]]  # the learner's adapter and every engine's served one


class LoraRun(msgspec.Struct):
    killed_records: list[dict]  # the killed run's metrics, as it left them
    killed_after_sync: list[Served]  # per step of the killed run
    kill_error: str  # how the killed run stopped
    resumed_from: str  # the checkpoint `--resume RUN_DIR` picks
    dropped_records: int  # the killed run's records after that checkpoint (trained again)
    checkpoint_learner: ParamChecksum  # the adapter the checkpoint holds (as served)
    at_resume: Served  # after the resume's first sync, before the resumed run's first step
    resumed_learner: ParamChecksum | None  # the controller's own record of it
    resumed_after_sync: list[Served]  # per step of the resumed run
    records: list[dict]  # the run directory's metrics after the resume: every step once
    wrong_slot_error: str
    merged_vs_learner: float  # mean |merged HF model - HF with the checkpoint's adapter (PEFT)| log-prob
    merged_vllm_vs_served: float  # mean |vLLM serving the merged folder - vLLM serving the adapter|
    merged_hf_vs_served: float  # mean |merged HF model (HF forward) - vLLM serving the adapter|
    base_vs_served: float  # the base model (HF) against vLLM serving the adapter: the adapter matters
    merged_vllm_vs_hf: float  # the merged folder, vLLM against HF (vLLM's own fp32 gap, no LoRA)
    max_merged_vllm_vs_served: float  # the largest single-token gap of merged_vllm_vs_served
    adapter_bytes: int


def cfg_for(run_dir: Path):
    return real_config(
        [
            "task.name=tests.integration._chat_task:make_task",
            f"train.total_steps={STEPS}",
            "train.max_lag=2",
            f"train.prompts_per_step={PROMPTS}",
            "train.checkpoint_every=2",
            "train.recover=off",  # the killed learner stops the run: this test resumes it by hand
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


def make_controller(
    cfg, run_dir: Path, resume_from: Path | None = None, model_dir: str | None = None
) -> tuple[Controller, MetricsSink]:
    from async_rl.cluster.placement import plan_placement

    sink = MetricsSink(run_dir, WandbConfig(mode="disabled"), {}, cfg.train.total_steps, stream=io.StringIO())
    model = Path(model_dir or smollm2_dir())
    return Controller(cfg, model, run_dir, plan_placement(cfg), resume_from=resume_from), sink


def served(controller: Controller) -> Served:
    learner, engines = controller.checksums()
    return learner, list(engines.values())


def mean_abs(a: list[list[float]], b: list[list[float]]) -> float:
    flat_a, flat_b = sum(a, []), sum(b, [])
    return sum(abs(x - y) for x, y in zip(flat_a, flat_b, strict=True)) / len(flat_a)


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


def kill_learner_after(controller: Controller, steps: int, after_sync: list[Served]):
    """between_steps: record what every engine serves; after `steps` steps SIGKILL learner rank 0's
    process (a crash: nothing of the run is stopped or saved on the way out)."""

    def between(step: int) -> None:
        after_sync.append(served(controller))
        if step + 1 == steps:
            pid = ray.get(controller.learner.actors[0].__ray_call__.remote(lambda learner: os.getpid()))
            os.kill(pid, signal.SIGKILL)

    return between


def read_at_start(controller: Controller, into: list[Served]) -> None:
    """What learner and engines hold once the controller started (for a resume: after the sync of the
    checkpoint's adapter, before the first step)."""
    start = controller.start

    def start_then_read() -> None:
        start()
        into.append(served(controller))

    controller.start = start_then_read


def vllm_logprobs_of(model_dir: Path, settings: EngineSettings, cpus: int, probe: Probe) -> list[list[float]]:
    """One GeneratorEngine like the run's (`settings`: the same vLLM arguments, dtype, seed, threads),
    serving `model_dir` as a plain model (no LoRA); started paused, so it leases nothing; its vLLM
    log-probs at the probe's positions. Stopped by its handle."""
    spec = msgspec.structs.replace(settings.spec, model_dir=str(model_dir), lora=None)
    engine = ray.remote(GeneratorEngine).options(num_cpus=cpus).remote(msgspec.structs.replace(settings, spec=spec), None)
    try:
        ray.get(engine.start.remote(True))
        return ray.get(engine.logprobs.remote(probe))
    finally:
        try:
            ray.get(engine.shutdown.remote(), timeout=60)
        finally:
            ray.kill(engine, no_restart=True)


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
        # The run: its learner is killed after step 3 (checkpoint step_2 is written, step 3 is not saved).
        controller, sink = make_controller(cfg_for(run_dir), run_dir)
        killed_after_sync: list[Served] = []
        try:
            controller.run(sink, kill_learner_after(controller, KILLED_AFTER, killed_after_sync))
            kill_error = ""
        except RunError as exc:
            kill_error = str(exc)
        finally:
            controller.shutdown()
            sink.close()
        killed_records = read_jsonl(run_dir / "metrics.jsonl")

        # `--resume RUN_DIR`, as launch does it: the newest complete checkpoint, the later records dropped.
        ckpt = checkpoint.latest(run_dir)
        dropped = checkpoint.trim_metrics(run_dir, checkpoint.load_state(ckpt).step)
        tensors, config = load_adapter(checkpoint_adapter_dir(ckpt))
        checkpoint_learner = checksum_of(served_tensors(tensors, config))
        controller, sink = make_controller(cfg_for(run_dir), run_dir, resume_from=ckpt)
        at_resume: list[Served] = []
        read_at_start(controller, at_resume)
        resumed_after_sync: list[Served] = []
        try:
            controller.run(sink, lambda step: resumed_after_sync.append(served(controller)))
            resumed_learner = controller.resumed_checksum
            adapter_bytes = ray.get(controller.learner.actors[0].weight_manifest.remote()).total_bytes
            # The last step's checkpoint, merged, against vLLM serving that same adapter (version 4).
            last = run_dir / "checkpoints" / f"step_{STEPS}"
            merged = export_merged(last, run_dir / "merged")
            # Samples of the last batch; the learner's own log-probs are not used (its packed, chunked
            # scoring path is ~1e-5 from a plain forward: too coarse here).
            probe = controller.learner.call(lambda a: a.probe_logprobs.remote(4))[0]
            engine = controller.generators.actors[0]
            served_lps = ray.get(engine.logprobs.remote(probe))  # vLLM with the adapter, version 4
            merged_lps = hf_logprobs(str(merged), probe)
            adapter_lps = hf_logprobs(model_dir, probe, last)  # the same HF forward, the adapter on (PEFT)
            base_lps = hf_logprobs(model_dir, probe)
            # A delivery into the wrong slot: the next sync must refuse to go on.
            ray.get(engine.__ray_call__.remote(deliver_into_another_slot))
            try:
                controller.runtime.sync_weights(controller.version)
                wrong_slot_error = ""
            except RunError as exc:
                wrong_slot_error = str(exc)
            engine_settings = controller.generators.make_settings(0)
            engine_cpus = controller.generators.cpus_per_engine
        finally:
            controller.shutdown()
            sink.close()
        records = read_jsonl(run_dir / "metrics.jsonl")
        # vLLM serving the merged folder, with the run's engine settings (started once the run's
        # processes are gone: one engine at a time on this machine).
        merged_served_lps = vllm_logprobs_of(merged, engine_settings, engine_cpus, probe)
    finally:
        ray.shutdown()
    return LoraRun(
        killed_records=killed_records,
        killed_after_sync=killed_after_sync,
        kill_error=kill_error,
        resumed_from=str(ckpt),
        dropped_records=dropped,
        checkpoint_learner=checkpoint_learner,
        at_resume=at_resume[0],
        resumed_learner=resumed_learner,
        resumed_after_sync=resumed_after_sync,
        records=records,
        wrong_slot_error=wrong_slot_error,
        merged_vs_learner=mean_abs(merged_lps, adapter_lps),
        merged_vllm_vs_served=mean_abs(merged_served_lps, served_lps),
        merged_hf_vs_served=mean_abs(merged_lps, served_lps),
        base_vs_served=mean_abs(base_lps, served_lps),
        merged_vllm_vs_hf=mean_abs(merged_served_lps, merged_lps),
        max_merged_vllm_vs_served=max(abs(x - y) for x, y in zip(sum(merged_served_lps, []), sum(served_lps, []), strict=True)),
        adapter_bytes=adapter_bytes,
    )


def check_every_engine_serves_the_learners(after_sync: list[Served]) -> None:
    previous = None
    for learner, engines in after_sync:
        assert engines and all(e.close_to(learner) for e in engines), (learner, engines)
        assert learner.count > 0 and (previous is None or not learner.close_to(previous))  # it trained
        previous = learner


def test_every_engine_serves_the_learners_adapter_after_each_sync(run):
    assert [r["version"] for r in run.killed_records] == list(range(1, KILLED_AFTER + 1))
    assert len(run.killed_after_sync) == KILLED_AFTER and len(run.resumed_after_sync) == STEPS - 2
    check_every_engine_serves_the_learners(run.killed_after_sync)
    check_every_engine_serves_the_learners([run.at_resume, *run.resumed_after_sync])


def test_samples_carry_adapter_versions_within_max_lag(run):
    for r in run.killed_records + run.records:
        assert r["lag_max"] <= 2 and r["generator_version"] == r["version"]  # synced every step
        assert r["step"] - r["lag_max"] >= max(0, r["step"] - 2)
        assert r["accounting_balanced"]
    # a batch's mean sample version is its step minus its mean lag: the 4th batch holds samples that
    # trained adapters (versions >= 1) generated, and none older than max_lag allows
    assert run.records[-1]["step"] - run.records[-1]["lag_mean"] > 0
    # The resumed run's engines start from the checkpoint's adapter (version 2), but the checkpoint also
    # keeps the groups generated and not yet trained (docs/operations.md), and the resumed run trains
    # them first: a resumed batch may hold samples of older adapters, never older than max_lag allows
    # (checked above for every batch), and none is lost across the kill.
    assert run.records[-1]["lost"] == 0


def test_a_sync_is_adapter_sized(run):
    full = (Path(smollm2_dir()) / "model.safetensors").stat().st_size  # every weight, fp32
    print(f"adapter update {run.adapter_bytes} bytes, full model {full} bytes")
    assert 0 < run.adapter_bytes < 0.05 * full


def test_delivery_into_the_wrong_slot_stops_the_sync_in_one_line(run):
    assert run.wrong_slot_error and "\n" not in run.wrong_slot_error
    assert "LoRA adapter" in run.wrong_slot_error, run.wrong_slot_error


def test_killed_run_resumes_from_the_adapter_checkpoint(run):
    # The SIGKILLed learner stopped the run in one line naming the checkpoint that --resume picks.
    assert run.kill_error.startswith("learner rank 0 died ("), run.kill_error
    assert run.kill_error.endswith(f"resume from checkpoint {run.resumed_from} (train.recover is off)"), run.kill_error
    assert Path(run.resumed_from).name == "step_2"
    # The resumed learner starts from the checkpoint's adapter and every engine serves it after the
    # first sync, before any step (close_to: the same values, summed in another order).
    learner, engines = run.at_resume
    assert learner.close_to(run.checkpoint_learner)
    assert engines and all(e.close_to(learner) for e in engines), (learner, engines)
    assert run.resumed_learner is not None and run.resumed_learner.close_to(run.checkpoint_learner)
    # Numbering continues from the checkpoint: step 3 (trained by the killed run, never saved) is
    # trained again as version 3, every step is in the run's metrics once.
    assert run.dropped_records == KILLED_AFTER - 2
    assert [r["step"] for r in run.records] == list(range(STEPS))
    assert [r["version"] for r in run.records] == list(range(1, STEPS + 1))
    # the sample accounting goes on from the checkpoint's: one batch trained per step
    assert [r["trained"] for r in run.records] == [PROMPTS * GROUP * (s + 1) for s in range(STEPS)]
    learner, engines = run.resumed_after_sync[-1]
    assert engines and all(e.close_to(learner) for e in engines)


def test_merged_export_scores_like_the_adapter(run):
    print(f"merged vs HF+adapter {run.merged_vs_learner:.2e}; vLLM merged vs vLLM+adapter "
          f"{run.merged_vllm_vs_served:.2e}; HF merged vs vLLM+adapter {run.merged_hf_vs_served:.2e}; "
          f"base vs vLLM+adapter {run.base_vs_served:.2e}; merged vLLM vs HF {run.merged_vllm_vs_hf:.2e}; "
          f"largest token gap vLLM merged vs vLLM+adapter {run.max_merged_vllm_vs_served:.2e}")
    assert run.merged_vs_learner < 1e-5  # the merge itself: HF against HF with the adapter (PEFT)
    # The claim: vLLM serving the merged folder against vLLM serving the adapter (fp32).
    assert run.merged_vllm_vs_served < 1e-5
    # HF's forward against vLLM's: vLLM's own fp32 gap to HF (~1e-5 here, the mismatch metric's)
    assert run.merged_hf_vs_served < 1e-4
    assert run.base_vs_served > 100 * max(run.merged_vs_learner, run.merged_vllm_vs_served)  # the adapter matters


def test_vllm_and_learner_logprobs_agree_with_the_adapter(run):
    mismatch = [r["logprob_mismatch"] for r in run.killed_records + run.records[2:]]  # every sync once
    print("mismatch after each sync:", [f"{m:.1e}" for m in mismatch], "sync s:", [r["sync_s"] for r in run.records])
    assert all(m is not None and m < 1e-4 for m in mismatch), mismatch


# ---- a vision-language model: LoRA on its language model --------------------------------------------

VL_STEPS = 3


class VlmLoraRun(msgspec.Struct):
    records: list[dict]
    after_sync: list[Served]  # per step
    sent: list[str]  # the names of one adapter update
    vision_moved: list[str]  # learner parameters of the vision tower (projector included) that moved
    vision_params: int  # how many there are
    final_learner: ParamChecksum  # the learner's adapter after the last step (as served)
    at_resume: Served  # `--resume` from the last checkpoint: after its first sync, before its first step
    resumed_records: list[dict]  # the run directory's metrics after the resumed run's one more step
    probe_images: int  # images among the probe's samples (the last batch's)
    served_vs_learner: float  # mean |vLLM serving the adapter - the learner| on the probe's tokens
    served_vs_base: float  # mean |vLLM serving the adapter - the learner's base (adapter disabled)|
    merged_vllm_vs_served: float  # mean |vLLM serving the merged export - vLLM serving the adapter|
    checkpoint_learner: ParamChecksum  # the run's last checkpoint's adapter (as served)


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory) -> VlmLoraRun:
    from transformers import AutoModelForImageTextToText

    from async_rl.config import load_config
    from async_rl.export_merged import export_merged
    from async_rl.models.tiny import resolve_model_path
    from tests._presets import model_cache

    model_dir = str(resolve_model_path("tiny-qwen2.5-vl", model_cache()))
    run_dir = tmp_path_factory.mktemp("vlm_lora_run")
    overrides = [
        f"model.cache_dir={model_cache()}",
        "logging.wandb.mode=disabled",
        f"logging.run_dir={run_dir}",
        "generators.kv_cache_gib=0.25",
        f"train.total_steps={VL_STEPS}",
        "train.prompts_per_step=2",
        "generators.group_size=4",
        "generators.max_inflight_prompts=4",
        "train.mismatch_probe_samples=4",
        "eval.enabled=false",
        "learner.lr=0.01",  # so that the adapter moves visibly in a few steps
        "learner.lora.enabled=true",
        f"learner.lora.rank={RANK}",
    ]
    cfg = load_config(REPO / "configs" / "vision_colour.yaml", overrides)
    after_sync: list[Served] = []
    t0 = time.monotonic()
    with real_controller(cfg, run_dir, {}, Path(model_dir)) as (controller, sink):
        controller.run(sink, lambda step: after_sync.append(served(controller)))
        learner = controller.learner.actors[0]
        manifest = ray.get(learner.weight_manifest.remote())
        vision = ray.get(learner.__ray_call__.remote(
            lambda d: {n: p.detach().clone() for n, p in d.backend.model.named_parameters() if n.startswith("model.visual.")}
        ))
        final_learner = served(controller)[0]
        # the last batch's samples scored by vLLM (the adapter served) against the learner with and
        # without its adapter: the adapter matters on these multimodal tokens, and vLLM applies it
        probe = ray.get(learner.probe_logprobs.remote(4))
        base_lps = ray.get(learner.__ray_call__.remote(base_probe, 4))
        served_lps = ray.get(controller.generators.actors[0].logprobs.remote(probe))
        engine_settings = controller.generators.make_settings(0)
        engine_cpus = controller.generators.cpus_per_engine
        controller.shutdown()  # one engine at a time: the run's, its resume's, one serving the merged export
        # `--resume` from the last checkpoint, one step more: the learner loads the adapter, the engines
        # are sent it before they generate
        last = run_dir / "checkpoints" / f"step_{VL_STEPS}"
        more = load_config(REPO / "configs" / "vision_colour.yaml", [*overrides, f"train.total_steps={VL_STEPS + 1}"])
        resumed, resumed_sink = make_controller(more, run_dir, last, model_dir)
        t1 = time.monotonic()
        at_resume: list[Served] = []
        read_at_start(resumed, at_resume)
        try:
            resumed.run(resumed_sink)
        finally:
            resumed.shutdown()
            resumed_sink.close()
        # the last checkpoint merged into a VLM folder, served by vLLM as a plain model on the same samples
        t2 = time.monotonic()
        merged_lps = vllm_logprobs_of(export_merged(last, run_dir / "merged"), engine_settings, engine_cpus, probe)
        print(f"VLM LoRA fixture: run {t1 - t0:.0f} s, resume {t2 - t1:.0f} s, merged export served {time.monotonic() - t2:.0f} s")
    base = dict(AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).named_parameters())
    tensors, config = load_adapter(checkpoint_adapter_dir(last))
    return VlmLoraRun(
        records=read_jsonl(run_dir / "metrics.jsonl")[:VL_STEPS],
        resumed_records=read_jsonl(run_dir / "metrics.jsonl"),
        at_resume=at_resume[0],
        after_sync=after_sync,
        sent=[t.name for b in manifest.buckets for t in b.tensors],
        vision_moved=[n for n, t in vision.items() if not torch.equal(t, base[n])],
        vision_params=len(vision),
        final_learner=final_learner,
        probe_images=sum(len(i) for i in probe.images),
        served_vs_learner=probe.mean_abs_diff(served_lps),
        served_vs_base=base_lps.mean_abs_diff(served_lps),
        merged_vllm_vs_served=mean_abs(merged_lps, served_lps),
        checkpoint_learner=checksum_of(served_tensors(tensors, config)),
    )


def test_vlm_engine_serves_the_learners_language_model_adapter(vlm_run):
    assert [r["version"] for r in vlm_run.records] == list(range(1, VL_STEPS + 1))
    # after every sync each engine's LoRA slots hold the learner's adapter (same values and count: every
    # adapter tensor, sent under PEFT's HF names, landed on a module of vLLM's language model), and it trains
    check_every_engine_serves_the_learners(vlm_run.after_sync)
    assert vlm_run.sent and all(n.startswith("base_model.model.model.language_model.layers.") for n in vlm_run.sent)
    # vLLM and the learner score the same multimodal samples (the colour task's, images sent along)
    mismatch = [r["logprob_mismatch"] for r in vlm_run.records]
    print("VLM LoRA mismatch after each sync:", [f"{m:.1e}" for m in mismatch])
    assert all(m is not None and m < 1e-4 for m in mismatch), mismatch
    print(f"VLM LoRA probe: vLLM vs learner {vlm_run.served_vs_learner:.1e}, vLLM vs the base {vlm_run.served_vs_base:.1e}")
    assert vlm_run.probe_images > 0 and vlm_run.served_vs_learner < 1e-4
    assert vlm_run.served_vs_base > 100 * vlm_run.served_vs_learner  # the adapter matters, and vLLM serves it


def test_vlm_lora_leaves_the_vision_tower_as_loaded_and_resumes_from_the_adapter_checkpoint(vlm_run):
    assert vlm_run.vision_params > 0 and not vlm_run.vision_moved, vlm_run.vision_moved[:3]
    assert vlm_run.checkpoint_learner.close_to(vlm_run.final_learner)
    # the resume's learner holds the checkpoint's adapter and every engine serves it before any step
    learner, engines = vlm_run.at_resume
    assert learner.close_to(vlm_run.checkpoint_learner)
    assert engines and all(e.close_to(learner) for e in engines), (learner, engines)
    assert [r["version"] for r in vlm_run.resumed_records] == list(range(1, VL_STEPS + 2))
    assert vlm_run.resumed_records[-1]["logprob_mismatch"] < 1e-4


def test_vlm_merged_export_served_by_vllm_scores_like_the_adapter(vlm_run):
    print(f"VLM merged export, vLLM vs vLLM serving the adapter: {vlm_run.merged_vllm_vs_served:.1e}")
    assert vlm_run.merged_vllm_vs_served < 1e-5
    assert vlm_run.served_vs_base > 100 * vlm_run.merged_vllm_vs_served
