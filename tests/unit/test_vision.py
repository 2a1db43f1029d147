"""Vision-language prompts without Ray or vLLM: torchvision's Python parts on the CPU torch, rendering
with the processor (placeholders expanded at the run's pixel bounds, bad images one line each), frames
that carry a group's images, the visual task, and the learner's micro-batches with images scoring
exactly what one sequence at a time scores, in every layout."""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from async_rl.chat import PromptRenderer, RenderError
from async_rl.config import VisionConfig
from async_rl.images import ImageError, check, encode_png, image_bytes
from async_rl.learner.batch.packing import packed, padded
from async_rl.learner.batch.shared_prefix import shared
from async_rl.learner.batch.vision_rows import SampleVision, VisionRows
from async_rl.learner.driver import shard_samples
from async_rl.learner.model.head import model_scores
from async_rl.learner.model.vision_inputs import VisionInputs, frozen_vision_tower
from async_rl.models.tiny import resolve_model_path
from async_rl.protocol import FrameError, Prompt, Sample, TrajectoryGroup, decode_groups, encode_groups
from async_rl.tasks.colour import COLOURS, ColourTask, blank_colour
from async_rl.vision import collapse, image_token_id, is_vision_model
from async_rl.vision_family import QWEN_VL


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> Path:
    return resolve_model_path("tiny-qwen2.5-vl", str(tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="module")
def vl_model(vl_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vl_dir).eval()


def image(h: int, w: int, seed: int = 0) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return encode_png(Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")))


# ---- the CPU route for torchvision -------------------------------------------------------------------


def test_torchvision_imports_here_and_a_qwen_vl_processor_constructs(vl_dir):
    import torchvision
    from transformers import AutoProcessor

    from async_rl import torchvision_cpu

    ops = torchvision.extension._has_ops()
    # the CPU tier has the CUDA wheel: its C++ ops cannot load, so the module left the fake kernels out
    assert torchvision_cpu.active() != ops
    processor = AutoProcessor.from_pretrained(vl_dir)
    assert type(processor).__name__ == "Qwen2_5_VLProcessor" and processor.video_processor is not None


def test_the_finder_steps_aside_when_torchvision_has_its_ops(monkeypatch):
    from async_rl import torchvision_cpu

    finder = torchvision_cpu._SkipFakeKernels()
    with_ops = types.SimpleNamespace(_has_ops=lambda: True)
    without = types.SimpleNamespace(_has_ops=lambda: False)
    monkeypatch.setitem(sys.modules, "torchvision.extension", with_ops)
    assert finder.find_spec(torchvision_cpu.TARGET, None) is None
    monkeypatch.setitem(sys.modules, "torchvision.extension", without)
    assert finder.find_spec(torchvision_cpu.TARGET, None) is not None
    assert finder.find_spec("torchvision.ops", None) is None  # only the one module


# ---- rendering --------------------------------------------------------------------------------------


def test_a_prompt_with_images_renders_with_each_placeholder_expanded_at_the_pixel_bounds(vl_dir):
    tid = image_token_id(vl_dir)
    small = PromptRenderer(vl_dir, vision=VisionConfig(max_images_per_prompt=2))
    big = PromptRenderer(vl_dir, vision=VisionConfig(min_pixels=112 * 112, max_pixels=112 * 112, max_images_per_prompt=2))
    prompt = Prompt(prompt_id=0, text="a<image>b<image>:", images=[image(56, 56), image(112, 112, 1)])
    ids, many = small.render(prompt), big.render(prompt)
    assert ids.count(tid) == 8 and many.count(tid) == 32  # 56x56: 4 tokens each; 112x112: 16
    assert collapse(ids, tid).count(tid) == 2  # what vLLM is given: one placeholder per image
    # no marker: the images go before the text
    plain = small.render(Prompt(prompt_id=1, text="ab:", images=[image(56, 56)]))
    assert plain.index(tid) < plain.index(small.tokenizer.convert_tokens_to_ids("a"))


@pytest.mark.parametrize(
    ("images", "text", "settings", "reason", "words"),
    [
        ([b"not an image"], "<image>:", VisionConfig(), "bad_image", "not a readable image"),
        ([image(64, 64)], "<image>:", VisionConfig(max_image_pixels=32 * 32), "image_too_large", "vision.max_image_pixels"),
        ([image(56, 56)] * 2, "<image><image>:", VisionConfig(), "too_many_images", "vision.max_images_per_prompt=1"),
        ([image(56, 56)] * 2, "<image>:", VisionConfig(max_images_per_prompt=2), "image_count", "2 image(s) for 1 '<image>'"),
    ],
)
def test_a_bad_image_prompt_is_one_line_with_its_reason(vl_dir, images, text, settings, reason, words):
    with pytest.raises(RenderError) as e:
        PromptRenderer(vl_dir, vision=settings).render(Prompt(prompt_id=0, text=text, images=images))
    assert e.value.reason == reason and words in str(e.value) and "\n" not in str(e.value)


def test_images_for_a_text_only_model_are_refused(model_dir):
    assert not is_vision_model(model_dir)
    with pytest.raises(RenderError, match="has no vision tower") as e:
        PromptRenderer(model_dir).render(Prompt(prompt_id=0, text="<image>:", images=[image(56, 56)]))
    assert e.value.reason == "images_without_vision"


def test_image_cells_are_paths_bytes_or_datasets_dicts(tmp_path):
    data = image(56, 56)
    (tmp_path / "a.png").write_bytes(data)
    assert image_bytes("a.png", tmp_path) == data
    assert image_bytes({"bytes": data, "path": None}) == data
    assert image_bytes({"bytes": None, "path": str(tmp_path / "a.png")}) == data
    with pytest.raises(ImageError, match="does not exist"):
        image_bytes("missing.png", tmp_path)
    with pytest.raises(ImageError, match="not int"):
        image_bytes(3)
    with pytest.raises(ImageError, match="not a readable image"):
        check(data[: len(data) // 2], 0)  # truncated


# ---- frames and the task ----------------------------------------------------------------------------


def test_a_groups_images_travel_in_its_frame_once():
    images = [image(56, 56), image(28, 28, 1)]
    g = TrajectoryGroup(
        prompt_id=3, engine_id=0, prompt_tokens=np.arange(5, dtype=np.int32),
        completions=[np.array([1, 2], np.int32)] * 4, logprobs=[np.zeros(2, np.float32)] * 4, rewards=[0.0] * 4,
        version_first=[0] * 4, version_last=[0] * 4, reward_status=[0] * 4, images=images,
    )
    frames = encode_groups("run", [g])
    assert sum(len(f) for f in frames) < sum(map(len, images)) + 400  # once per group, not per sample
    _, (back,) = decode_groups(frames, "run")
    assert back.images == images
    _, (text,) = decode_groups(encode_groups("run", [dataclasses.replace(g, images=None)]), "run")
    assert text.images is None
    with pytest.raises(FrameError, match="image 1 .* is not a readable image") as e:
        decode_groups(encode_groups("run", [dataclasses.replace(g, images=[images[0], b"GIF89a..."])]), "run")
    assert e.value.reason == "bad_image" and e.value.header is not None  # the buffer releases its prompt


def test_the_colour_tasks_images_tell_the_answer_and_the_blank_ones_do_not():
    from async_rl.images import decode

    task, blank = ColourTask(), blank_colour()
    prompts = [p for _, p in zip(range(40), task.prompts(0), strict=False)]
    assert {p.answer for p in prompts} == set(COLOURS) and {p.text for p in prompts} == {"<image>colour:"}
    for p in prompts:
        pixels = np.asarray(decode(p.images[0])).reshape(-1, 3)
        lit = pixels[pixels.sum(axis=1) > 0]
        assert np.abs(lit.mean(axis=0) - COLOURS[p.answer]).max() <= 20
    assert all(not np.asarray(decode(p.images[0])).any() for _, p in zip(range(8), blank.prompts(0), strict=False))
    assert task.reward(Sample(prompt=prompts[0], completion=prompts[0].answer * 8)) == 1.0
    assert task.reward(Sample(prompt=prompts[0], completion="")) == 0.0


# ---- the learner ------------------------------------------------------------------------------------


def test_vision_rows_place_images_at_prompt_placeholders_and_give_a_text_sequence_its_own_positions():
    rope = np.array([[0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 2, 3]], dtype=np.int64)
    v = SampleVision(b"k", torch.zeros(4, 2), torch.tensor([[1, 2, 2]]), rope, image_token_id=9)
    rows = VisionRows()
    rows.place(0, 0, 8, 6, v)
    rows.place(0, 8, 11, 2, None)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]])
    ids = torch.tensor([[5, 9, 9, 9, 9, 6, 9, 7, 9, 5, 5, 5]])  # a sampled 9 in the completion, one in a text prompt
    batch = rows.build(positions, ids)
    assert batch.image_mask[0].nonzero()[:, 0].tolist() == [1, 2, 3, 4]  # the image's placeholders only
    assert batch.rope[:, 0, :6].tolist() == rope.tolist()
    assert batch.rope[:, 0, 6:8].tolist() == [[4, 5]] * 3  # after the prompt: its largest + 1 on
    assert batch.rope[:, 0, 8:].tolist() == [[0, 1, 2, 3]] * 3  # the text sequence and the row's tail


def _groups(vision: VisionInputs) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(0)
    specs = [([(56, 56)], "<image>ab:"), ([(112, 84), (28, 56)], "x<image>y<image>z:"), ([], "abc:"), ([(56, 56)], "<image>ab:")]
    groups = []
    for gi, (sizes, text) in enumerate(specs):
        ims = [image(h, w, 10 * gi + k) for k, (h, w) in enumerate(sizes)]
        ids = vision.vision.render([("user", text)], ims, 0) if ims else [13, 14, 15, 30]
        comps = [rng.integers(3, 40, size=int(rng.integers(2, 7))).astype(np.int32) for _ in range(3)]
        groups.append(TrajectoryGroup(
            prompt_id=gi, engine_id=0, prompt_tokens=np.array(ids, np.int32), completions=comps,
            logprobs=[np.zeros(len(c), np.float32) for c in comps], rewards=[0.0] * 3, version_first=[0] * 3,
            version_last=[0] * 3, reward_status=[0] * 3, images=ims or None,
        ))
    return groups


def test_micro_batches_with_images_score_what_one_sequence_at_a_time_scores(vl_dir, vl_model):
    """Several images of different sizes in one packed micro-batch, a text-only group among them, and
    two groups with equal tokens but other pixels: packed, padded and shared-prompt layouts all equal the
    model's own forward of each sequence alone (its 3-D positions from `mm_token_type_ids`)."""
    vision = VisionInputs(vl_model, str(vl_dir), VisionConfig(min_pixels=28 * 28, max_pixels=112 * 112, max_images_per_prompt=2))
    groups = _groups(vision)
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
                lp = torch.log_softmax(vl_model(input_ids=ids, **kw).logits[0].float(), -1)
            p = len(g.prompt_tokens)
            want.append(lp[p - 1 : -1].gather(1, torch.from_numpy(c).long()[:, None])[:, 0].numpy())
    samples = shard_samples(groups, vision=vision)
    assert samples[0].vision.key != samples[9].vision.key  # equal tokens, other pixels: two prompts
    layouts = {"packed": packed(samples, 64), "padded": padded(samples), "shared": shared(samples, 64)}
    for name, mb in layouts.items():
        with torch.no_grad():
            logp, _, _ = model_scores(vl_model, mb.model_inputs(torch.device("cpu")), mb.targets, mb.span_index(), 1.0, 1024,
                                      entropy=False)
        err = max(float(np.abs(a - b).max()) for a, b in zip(mb.per_sequence(logp), want, strict=True))
        assert err < 1e-5, f"{name}: {err}"
    # the shared layout runs the vision tower once per group, the others once per sample
    patches = sum(int(s.vision.pixel_values.shape[0]) for s in samples if s.vision is not None)
    assert layouts["packed"].vision.pixel_values.shape[0] == patches
    assert layouts["shared"].vision.pixel_values.shape[0] == patches // 3


def test_a_group_whose_tokens_do_not_fit_its_images_stops_the_step_in_one_line(vl_dir, vl_model):
    from async_rl.errors import RunError

    vision = VisionInputs(vl_model, str(vl_dir), VisionConfig(max_pixels=112 * 112, min_pixels=112 * 112))
    g = _groups(VisionInputs(vl_model, str(vl_dir), VisionConfig()))[0]  # rendered at 56x56: 4 image tokens
    with pytest.raises(RunError, match=r"hold 4 image tokens, its 1 image\(s\) make 16 here"):
        vision.of(g)


def test_freeze_vision_keeps_the_projector_and_the_language_model_training(vl_dir):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vl_dir)
    assert frozen_vision_tower(model, QWEN_VL) > 0
    training = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(".merger." in n for n in training) and any("language_model" in n for n in training)
    assert not any(".visual.blocks." in n or "patch_embed" in n for n in training)
