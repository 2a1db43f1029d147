"""The third vision-language family, Qwen3-VL (the `tiny-qwen3-vl` preset), without Ray or vLLM: 16-pixel
patches within the run's pixel bounds, the family chosen from config.json's model_type; the learner's
micro-batches with its images, on 3-D positions from Qwen3-VL's own get_rope_index and with DeepStack
features added at the prompts' placeholders, scoring exactly what the model's own forward (with
pixel_values) scores one sequence at a time, in every layout; and freeze_vision leaving the patch merger,
the DeepStack mergers and the language model to train."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from async_rl.chat import PromptRenderer
from async_rl.config import VisionConfig, load_config
from async_rl.learner.batch.packing import packed, padded
from async_rl.learner.batch.shared_prefix import shared
from async_rl.learner.driver import shard_samples
from async_rl.learner.model.head import model_scores
from async_rl.learner.model.vision_embed import DEEPSTACK_KEYS, with_image_embeds
from async_rl.learner.model.vision_inputs import VisionInputs, frozen_vision_tower
from async_rl.models.tiny import model_vision_type, resolve_model_path
from async_rl.protocol import Prompt
from async_rl.vision import VisionModel, collapse, image_token_id
from async_rl.vision_family import QWEN3_VL, family_of, model_type
from async_rl.vision_settings import family_settings_error
from tests.unit.test_vision import _groups, image

BOUNDS = VisionConfig(min_pixels=32 * 32, max_pixels=128 * 128, max_images_per_prompt=2)


@pytest.fixture(scope="module")
def q3_dir(tmp_path_factory) -> Path:
    return resolve_model_path("tiny-qwen3-vl", str(tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="module")
def q3_model(q3_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(q3_dir).eval()


def test_the_preset_is_a_qwen3_vl_with_deepstack_and_16_pixel_patches(q3_dir):
    from transformers import AutoProcessor

    assert model_type(q3_dir) == "qwen3_vl" and family_of("qwen3_vl") is QWEN3_VL
    assert model_vision_type("tiny-qwen3-vl", "") == "qwen3_vl"
    config = json.loads((q3_dir / "config.json").read_text())
    assert config["vision_config"]["deepstack_visual_indexes"] == [0, 1] and config["text_config"]["head_dim"] >= 32
    assert type(AutoProcessor.from_pretrained(q3_dir)).__name__ == "Qwen3VLProcessor"
    tid = image_token_id(q3_dir)
    renderer = PromptRenderer(q3_dir, vision=BOUNDS)
    ids = renderer.render(Prompt(prompt_id=0, text="a<image>b<image>:", images=[image(112, 84), image(28, 56, 1)]))
    # 112x84 -> 128x96 (8x6 patches of 16, 12 tokens after the 2x2 merger); 28x56 -> 32x64 (2 tokens)
    assert ids.count(tid) == 12 + 2 and collapse(ids, tid).count(tid) == 2
    px = VisionModel(q3_dir, BOUNDS).pixels([image(112, 84), image(28, 56, 1)])
    assert px.image_grid_thw.tolist() == [[1, 8, 6], [1, 2, 4]] and px.tokens_per_image == [12, 2]
    assert family_settings_error(load_config(None, ["model.path=x", "vision.max_pixels=4096"]), "qwen3_vl") is None


def _want(vision: VisionInputs, model, groups) -> list[np.ndarray]:
    """Each sample's completion log-probs from the HF model's own forward of it alone (pixel_values, grids
    and mm_token_type_ids: its own placement of the features and of DeepStack's, its own 3-D positions)."""
    want = []
    for g in groups:
        for c in g.completions:
            ids = torch.tensor(np.concatenate([g.prompt_tokens, c]), dtype=torch.long)[None]
            kw = {}
            if g.images:
                px = vision.vision.pixels(g.images)
                kw = {"pixel_values": px.pixel_values, "image_grid_thw": px.image_grid_thw,
                      "mm_token_type_ids": (ids == vision.vision.image_token_id).int()}
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=ids, **kw).logits[0].float(), -1)
            p = len(g.prompt_tokens)
            want.append(lp[p - 1 : -1].gather(1, torch.from_numpy(c).long()[:, None])[:, 0].numpy())
    return want


def test_micro_batches_with_qwen3_vl_images_score_what_the_models_own_forward_scores(q3_dir, q3_model):
    """Images of three sizes (2 to 12 tokens each), two in one prompt, a text group among them and two
    groups with equal tokens but other pixels: packed, padded and shared-prompt layouts, on the chunked
    head and the full one, equal the HF forward of each sequence alone; without the DeepStack features
    they would not (the test sees them)."""
    vision = VisionInputs(q3_model, str(q3_dir), BOUNDS)
    groups = _groups(vision)
    want = _want(vision, q3_model, groups)
    samples = shard_samples(groups, vision=vision)
    assert all(s.vision is None or s.vision.rope is not None for s in samples)  # 3-D positions
    assert samples[0].vision.key != samples[9].vision.key  # equal tokens, other pixels: two prompts
    layouts = {"packed": packed(samples, 128), "padded": padded(samples), "shared": shared(samples, 128)}
    for name, mb in layouts.items():
        inputs = mb.model_inputs(torch.device("cpu"))
        for chunk in (1024, 0):
            with torch.no_grad():
                logp, _, _ = model_scores(q3_model, inputs, mb.targets, mb.span_index(), 1.0, chunk, entropy=False)
            err = max(float(np.abs(a - b).max()) for a, b in zip(mb.per_sequence(logp), want, strict=True))
            assert err < 1e-5, f"{name}, chunk {chunk}: {err}"
    # DeepStack matters here: the language model without its features scores otherwise
    mb = layouts["packed"]
    with torch.no_grad():
        embedded = with_image_embeds(q3_model, mb.model_inputs(torch.device("cpu")))
        assert len(embedded["deepstack_visual_embeds"]) == 2
        plain = {k: v for k, v in embedded.items() if k not in DEEPSTACK_KEYS}
        last = q3_model.base_model.language_model(**plain).last_hidden_state
        logp = torch.log_softmax(q3_model.get_output_embeddings()(last).float(), -1)
        logp = logp.gather(-1, mb.targets.long().unsqueeze(-1))[..., 0]
    off = max(float(np.abs(a - b).max()) for a, b in zip(mb.per_sequence(logp), want, strict=True))
    assert off > 1e-3, off
    # the shared layout runs the vision tower once per group, the others once per sample
    patches = sum(int(s.vision.pixel_values.shape[0]) for s in samples if s.vision is not None)
    assert layouts["packed"].vision.pixel_values.shape[0] == patches
    assert layouts["shared"].vision.pixel_values.shape[0] == patches // 3


def test_a_sampled_placeholder_takes_no_deepstack_feature(q3_dir, q3_model):
    """A completion holding the image placeholder token (a random policy samples it): the learner scores
    it as text, with neither the merger's nor DeepStack's features, as vLLM does; the prompt's images are
    scored as before."""
    vision = VisionInputs(q3_model, str(q3_dir), BOUNDS)
    groups = _groups(vision)[:1]
    tid = vision.vision.image_token_id
    groups[0].completions[0] = np.array([5, tid, 7, 8], np.int32)
    groups[0].logprobs[0] = np.zeros(4, np.float32)
    mb = packed(shard_samples(groups, vision=vision), 128)
    inputs = mb.model_inputs(torch.device("cpu"))
    assert int(inputs["image_mask"].sum()) == 3 * 4  # three samples' prompts of 4 tokens; not the sampled one
    with torch.no_grad():
        logp, _, _ = model_scores(q3_model, inputs, mb.targets, mb.span_index(), 1.0, 1024, entropy=False)
    # the HF forward of the same sequence, its sampled placeholder made text: the features go to the
    # prompt's placeholders only when the sampled one is not an image token to it (its embedding as text)
    g = groups[0]
    ids = torch.tensor(np.concatenate([g.prompt_tokens, g.completions[0]]), dtype=torch.long)[None]
    px = vision.vision.pixels(g.images)
    kinds = torch.zeros_like(ids, dtype=torch.int32)
    kinds[0, : len(g.prompt_tokens)] = (ids[0, : len(g.prompt_tokens)] == tid).int()
    positions, _ = q3_model.base_model.get_rope_index(ids, kinds, px.image_grid_thw)
    with torch.no_grad():
        embeds = q3_model.base_model.get_input_embeddings()(ids)
        out = q3_model.base_model.get_image_features(px.pixel_values, px.image_grid_thw, return_dict=True)
        mask = kinds.bool()
        embeds = embeds.masked_scatter(mask.unsqueeze(-1).expand_as(embeds), torch.cat(out.pooler_output))
        flat = torch.arange(ids.shape[1])[None]
        last = q3_model.base_model.language_model(
            inputs_embeds=embeds, position_ids=torch.cat([flat[None], positions]), visual_pos_masks=mask,
            deepstack_visual_embeds=[torch.cat(level) for level in out.deepstack_features],
        ).last_hidden_state
        lp = torch.log_softmax(q3_model.get_output_embeddings()(last)[0].float(), -1)
    p = len(g.prompt_tokens)
    want = lp[p - 1 : -1].gather(1, torch.from_numpy(g.completions[0]).long()[:, None])[:, 0].numpy()
    assert float(np.abs(mb.per_sequence(logp)[0] - want).max()) < 1e-5


def test_freeze_vision_keeps_the_mergers_and_the_language_model_training(q3_dir):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(q3_dir)
    assert frozen_vision_tower(model, QWEN3_VL) > 0
    training = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(".visual.merger." in n for n in training) and any("language_model" in n for n in training)
    assert any(".visual.deepstack_merger_list.1." in n for n in training)  # DeepStack's mergers: vLLM's connector too
    assert not any(".visual.blocks." in n or "patch_embed" in n or "pos_embed" in n for n in training)


def test_every_weight_the_learner_may_send_has_a_name_vllm_loads(q3_dir, q3_model):
    """What a sync sends is `named_parameters()` (a tied weight once): every name is one the preset's
    safetensors hold, the names vLLM's Qwen3-VL loader maps at start-up (model.visual.*, including the
    DeepStack mergers, and model.language_model.*), so learner.freeze_vision=false sends names it knows too."""
    from safetensors import safe_open

    with safe_open(q3_dir / "model.safetensors", "pt") as f:
        saved = set(f.keys())  # noqa: SIM118 (a safetensors handle)
    names = {n for n, _ in q3_model.named_parameters()}
    assert names <= saved and "lm_head.weight" not in names  # tied to the embeddings: sent once
    assert all(n.startswith(("model.visual.", "model.language_model.")) for n in names)
