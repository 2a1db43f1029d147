"""The GPU learner benchmark's VLM rows on the CPU (benchmarks/learner_gpu.py, shape `tiny-vl`): the batch's
prompts hold images whose placeholders the learner's own processor expanded, and the `combined` child (our
learner), the `trl` child (plain HF with pixel_values and image_grid_thw) and the `fp32` scoring child each run
here in-process, with finite losses and the same log-probs (all fp32 on the CPU), so a device only times them."""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import learner_gpu as lg  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("bench") / "tiny-vl"
    assert lg.make_model(dest, "tiny-vl") < 2_000_000  # the language model's parameters
    return dest


def child_args(model_dir: Path, variant: str, score: Path) -> argparse.Namespace:
    return argparse.Namespace(shape="tiny-vl", variant=variant, model_dir=str(model_dir), score_file=str(score),
                              prompts=2, group_size=2, max_completion=24, tokens=2048, steps=1, score_samples=4,
                              profile_file=None)


def test_the_vlm_batch_holds_each_images_tokens_as_the_learner_counts_them(model_dir):
    from async_rl.learner.model.vision_inputs import VisionInputs

    groups = lg.groups_of("tiny-vl", model_dir, 3, 2, 24)
    # the batch's images alone, no forward: a stand-in model whose positions are not asked for
    stand_in = types.SimpleNamespace(base_model=types.SimpleNamespace(get_rope_index=None))
    vision = VisionInputs(stand_in, str(model_dir), lg.vision_settings("tiny-vl"))
    sizes = {vision.vision.image_tokens(g.prompt_tokens) for g in groups}
    assert len(sizes) > 1, sizes  # images of several sizes
    for g in groups:  # the learner's own check (a mismatch raises) and one image per prompt
        assert vision.of(g).image_grid_thw.shape == (1, 3)
        image_id = vision.vision.image_token_id
        assert all(not np.isin(c, [image_id]).any() for c in g.completions)  # no sampled placeholder
    again = lg.groups_of("tiny-vl", model_dir, 3, 2, 24)  # every child builds the same batch
    assert all(np.array_equal(a.prompt_tokens, b.prompt_tokens) and a.images == b.images for a, b in zip(groups, again, strict=True))


def test_combined_trl_and_fp32_children_run_on_the_cpu_with_the_same_log_probs(model_dir, tmp_path):
    scores = {v: tmp_path / f"{v}.npy" for v in ("combined", "trl", "fp32")}
    ours = lg.learner_child(child_args(model_dir, "combined", scores["combined"]), "cpu")
    trl = lg.trl_child(child_args(model_dir, "trl", scores["trl"]), "cpu")
    lg.learner_child(child_args(model_dir, "fp32", scores["fp32"]), "cpu")
    assert ours["learner"]["freeze_vision"] and ours["learner"]["activation_checkpointing"]  # the recipe's
    for row in (ours, trl):
        assert np.isfinite(row["loss"]) and row["loss"] != 0.0 and len(row["steps_s"]) == 1
    diff = lg.logp_difference(scores)
    assert set(diff) == {"combined", "trl"}
    assert all(d["max_abs"] < 1e-4 for d in diff.values()), diff  # fp32 everywhere on the CPU: the same scores


def test_the_3b_shape_has_qwen2_5_vl_3bs_widths_and_its_images_the_recipes_token_counts(tmp_path):
    """The 3B shape on the meta device (no memory: never built on the CPU) and its batch at the recipe's pixel
    bounds: 256 to 1,280 tokens an image, images of several sizes, every prompt's count as the learner checks."""
    import torch
    from transformers import AutoModelForImageTextToText

    cfg, processor = lg.vl_parts("qwen2.5-vl-3b")
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())
    assert 3.70e9 < total < 3.80e9 and 3.05e9 < lg.language_params(model) < 3.15e9  # HF: 3.75B, the LM 3.09B
    processor.save_pretrained(tmp_path)  # what the learner and the HF step read (no weights needed here)
    cfg.save_pretrained(tmp_path)  # its model_type: the learner's processor is chosen by family
    from async_rl.vision import VisionModel

    vision = VisionModel(tmp_path, lg.vision_settings("qwen2.5-vl-3b"))
    groups = lg.make_vl_groups(tmp_path, "qwen2.5-vl-3b", 8, 2, 64)
    tokens = [vision.image_tokens(g.prompt_tokens) for g in groups]
    assert all(256 <= t <= 1280 for t in tokens) and len(set(tokens)) > 4, tokens
    assert [sum(vision.pixels(g.images).tokens_per_image) for g in groups] == tokens
