"""The second vision-language family, LLaVA (the `tiny-llava` preset), without Ray or vLLM: a processor
with no video part that resizes every image to one size, so any image makes the same tokens; the family
chosen from config.json's model_type (a family not built refused in one line, as are pixel bounds LLaVA
does not take); the learner's micro-batches with its images, on 1-D positions, scoring exactly what the
model's own forward scores one sequence at a time, in every layout; and freeze_vision leaving the
projector (outside the tower) and the language model to train."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from async_rl.chat import PromptRenderer
from async_rl.config import VisionConfig, load_config
from async_rl.errors import RunError
from async_rl.learner.batch.packing import packed, padded
from async_rl.learner.batch.shared_prefix import shared
from async_rl.learner.driver import shard_samples
from async_rl.learner.model.head import model_scores
from async_rl.learner.model.vision_inputs import VisionInputs, frozen_vision_tower, unused_tower_weights
from async_rl.models.tiny import model_vision_type, resolve_model_path
from async_rl.models.tiny_llava import PRESETS
from async_rl.protocol import Prompt
from async_rl.vision import VisionModel, collapse, image_token_id
from async_rl.vision_family import LLAVA, QWEN_VL, family_of, model_type
from async_rl.vision_settings import family_settings_error
from tests.unit.test_vision import _groups, image

TOKENS = PRESETS["tiny-llava"].tokens_per_image  # 16: 56x56 in patches of 14


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> Path:
    return resolve_model_path("tiny-llava", str(tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="module")
def llava_model(llava_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(llava_dir).eval()


def test_the_preset_is_a_llava_whose_processor_has_no_video_part_and_any_image_makes_the_same_tokens(llava_dir):
    from transformers import AutoProcessor

    assert model_type(llava_dir) == "llava" and family_of("llava") is LLAVA and model_vision_type("tiny-llava", "") == "llava"
    processor = AutoProcessor.from_pretrained(llava_dir)
    assert type(processor).__name__ == "LlavaProcessor" and not hasattr(processor, "video_processor")
    assert json.loads((llava_dir / "config.json").read_text())["text_config"]["head_dim"] >= 32  # vLLM's CPU attention
    from safetensors import safe_open

    with safe_open(llava_dir / "model.safetensors", "pt") as f:  # the published layout, which vLLM loads
        tower = [k for k in f.keys() if "vision_tower" in k]  # noqa: SIM118 (a safetensors handle)
    assert tower and all(k.startswith("vision_tower.vision_model.") for k in tower)
    tid = image_token_id(llava_dir)
    renderer = PromptRenderer(llava_dir, vision=VisionConfig(max_images_per_prompt=2))
    ids = renderer.render(Prompt(prompt_id=0, text="a<image>b<image>:", images=[image(112, 84), image(20, 300, 1)]))
    assert ids.count(tid) == 2 * TOKENS and collapse(ids, tid).count(tid) == 2
    px = VisionModel(llava_dir, VisionConfig()).pixels([image(112, 84), image(20, 300, 1)])
    assert px.image_grid_thw is None and px.tokens_per_image == [TOKENS] * 2
    assert tuple(px.pixel_values.shape) == (2, 3, 56, 56)


@pytest.mark.parametrize(
    ("kind", "overrides", "words"),
    [
        ("gemma3", [], "model.path 'x' is a vision-language model of type 'gemma3', not built yet: async_rl trains"),
        ("idefics3", [], "of type 'idefics3', not built yet"),
        ("llava", ["vision.max_pixels=3136"], "vision.min_pixels/max_pixels: model.path 'x' is a LLaVA model"),
        ("llava", ["learner.freeze_vision=false"], "learner.freeze_vision=false: model.path 'x' is a LLaVA model"),
    ],
)
def test_a_family_not_built_and_pixel_bounds_llava_does_not_take_are_one_line(kind, overrides, words):
    cfg = load_config(None, ["model.path=x", *overrides])
    why = family_settings_error(cfg, kind)
    assert why is not None and words in why and "\n" not in why
    assert family_settings_error(load_config(None, ["model.path=x"]), "llava") is None
    assert family_settings_error(load_config(None, ["model.path=x", "vision.max_pixels=3136"]), "qwen2_5_vl") is None


def test_a_folder_of_a_family_not_built_is_refused_when_its_processor_would_load(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "vision_config": {}}))
    with pytest.raises(RunError, match="of type 'gemma3', not built yet") as e:
        VisionModel(tmp_path, VisionConfig())
    assert "\n" not in str(e.value)


def test_micro_batches_with_llava_images_score_what_the_models_own_forward_scores(llava_dir, llava_model):
    """Images of different sizes on disk (one size after the processor), a text group among them and two
    groups with equal tokens but other pixels: packed, padded and shared-prompt layouts equal the HF
    model's forward of each sequence alone (its own placement of the features, 1-D positions)."""
    vision = VisionInputs(llava_model, str(llava_dir), VisionConfig(max_images_per_prompt=2))
    groups = _groups(vision)
    want = []
    for g in groups:
        for c in g.completions:
            ids = torch.tensor(np.concatenate([g.prompt_tokens, c]), dtype=torch.long)[None]
            kw = {"pixel_values": vision.vision.pixels(g.images).pixel_values} if g.images else {}
            with torch.no_grad():
                lp = torch.log_softmax(llava_model(input_ids=ids, **kw).logits[0].float(), -1)
            p = len(g.prompt_tokens)
            want.append(lp[p - 1 : -1].gather(1, torch.from_numpy(c).long()[:, None])[:, 0].numpy())
    samples = shard_samples(groups, vision=vision)
    assert all(s.vision is None or s.vision.rope is None for s in samples)  # 1-D positions: no get_rope_index
    assert samples[0].vision.key != samples[9].vision.key  # equal tokens, other pixels: two prompts
    layouts = {"packed": packed(samples, 128), "padded": padded(samples), "shared": shared(samples, 128)}
    for name, mb in layouts.items():
        inputs = mb.model_inputs(torch.device("cpu"))
        assert "image_grid_thw" not in inputs and (inputs.get("position_ids") is None or inputs["position_ids"].dim() == 2)
        with torch.no_grad():
            logp, _, _ = model_scores(llava_model, inputs, mb.targets, mb.span_index(), 1.0, 1024, entropy=False)
        err = max(float(np.abs(a - b).max()) for a, b in zip(mb.per_sequence(logp), want, strict=True))
        assert err < 1e-5, f"{name}: {err}"
    # the shared layout runs the vision tower once per group, the others once per sample
    images = sum(int(s.vision.pixel_values.shape[0]) for s in samples if s.vision is not None)
    assert layouts["packed"].vision.pixel_values.shape[0] == images
    assert layouts["shared"].vision.pixel_values.shape[0] == images // 3


def test_freeze_vision_keeps_llavas_projector_and_language_model_training(llava_dir):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(llava_dir)
    assert frozen_vision_tower(model, LLAVA) > 0
    training = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("multi_modal_projector" in n for n in training) and any("language_model" in n for n in training)
    assert not any("vision_tower" in n for n in training)
    with pytest.raises(RunError, match="names no vision tower"):  # Qwen's tower name on a LLaVA: one line
        frozen_vision_tower(AutoModelForImageTextToText.from_pretrained(llava_dir), QWEN_VL)


def test_the_served_checksum_leaves_out_the_tower_layers_llava_never_uses(llava_model):
    """vision_feature_layer -2 of 2 CLIP layers: the second layer and the final norm change nothing the
    model computes, and vLLM does not load them (the engine's checksum covers the rest)."""
    unused = unused_tower_weights(llava_model, LLAVA)
    names = {n for n, _ in llava_model.named_parameters() if unused(n)}
    assert names and all(".encoder.layers.1." in n or ".post_layernorm." in n for n in names)
    assert not any(unused(n) for n, _ in llava_model.named_parameters() if ".layers.0." in n or "language_model" in n)
    assert not any(unused_tower_weights(llava_model, QWEN_VL)(n) for n in names)  # a family reading the last layer
