"""Multi-turn episodes of a vision-language model (the tiny Qwen2.5-VL preset, no vLLM): an environment
turn that shows an image (the `zoom` environment's crop) is rendered by the processor with its
placeholders expanded and masked from the loss, the frame carries the episode's images, and the learner
puts image features at the prompt's and the environment's placeholders (never at one the policy
sampled), with 3-D positions over the whole episode: its layouts score what the model's own forward of
each sequence scores."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from async_rl.config import VisionConfig, load_config
from async_rl.envs.episode import EpisodeImages, ModelTurn, run_episode
from async_rl.envs.vision_delta import VisionChatDelta
from async_rl.envs.zoom import ZoomEnvironment, zoomed
from async_rl.learner.batch.packing import packed, padded
from async_rl.learner.batch.shared_prefix import shared
from async_rl.learner.driver import shard_samples
from async_rl.learner.model.head import model_scores
from async_rl.learner.model.vision_inputs import VisionInputs
from async_rl.models.tiny import resolve_model_path
from async_rl.protocol import ChatMessage, Prompt, Sample, TrajectoryGroup, decode_groups, encode_groups
from async_rl.tasks.colour import ColourTask
from async_rl.vision import VisionModel
from async_rl.vision_settings import vision_error

SETTINGS = VisionConfig(min_pixels=28 * 28, max_pixels=112 * 112, max_images_per_prompt=2)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> Path:
    return resolve_model_path("tiny-qwen2.5-vl", str(tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="module")
def vision(vl_dir) -> VisionModel:
    return VisionModel(vl_dir, SETTINGS)


@pytest.fixture(scope="module")
def delta(vision) -> VisionChatDelta:
    eot = vision.processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    return VisionChatDelta.for_vision(vision, [eot], 4096 * 4096, "env=zoom")


def _prompt(seed: int = 0) -> Prompt:
    return next(iter(ColourTask().prompts(seed)))


def scripted(turns: list[list[int]], eot: int):
    """A 'model' that answers each turn with the given token ids (the end-of-turn token appended)."""
    seen: list[list[int]] = []
    it = iter(turns)

    async def generate(ids: list[int], budget: int) -> ModelTurn:
        seen.append(list(ids))
        toks = next(it) + [eot]
        return ModelTurn(toks, [-0.5] * len(toks), "r", "stop", version=len(seen) - 1)

    return generate, seen


def _episode(vision, delta, turns, prompt):
    prompt_ids = vision.render([("user", prompt.text)], list(prompt.images), 0)
    generate, seen = scripted(turns, delta.end_of_turn_id)
    images = EpisodeImages(vision.image_token_id, len(prompt_ids), SETTINGS.max_images_per_prompt - 1)

    def reward(sample: Sample) -> float:
        return ColourTask().reward(sample)

    result = asyncio.run(run_episode(
        ZoomEnvironment(reward).start(prompt), prompt_ids, [ChatMessage("user", prompt.text)], generate, delta, 3, 4096,
        images,
    ))
    return prompt_ids, result, seen, images


def test_a_zoom_episode_shows_its_crop_masked_and_the_frame_carries_it(vision, delta):
    prompt = _prompt()
    prompt_ids, result, seen, images = _episode(vision, delta, [[11, 12], [13]], prompt)
    tid = vision.image_token_id
    assert result.finish_reason == "stop" and result.turns == 2 and result.images == [zoomed(prompt.images[0])]
    comp, mask = np.asarray(result.completion_ids), np.asarray(result.loss_mask)
    env = comp[mask == 0]
    assert int((env == tid).sum()) == 4  # the crop at the image's 56x56: 4 placeholders, all masked
    assert int((comp[mask == 1] == tid).sum()) == 0
    text = vision.processor.tokenizer.decode(env)
    # the preset's template has no roles: the turn is the crop, then the prompt's text again
    assert text == "<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>closer look. colour:"
    # the second turn is generated from every token so far; the episode's images end at the crop's last placeholder
    assert seen[1] == prompt_ids + result.completion_ids[: len(seen[1]) - len(prompt_ids)]
    assert images.span == len(prompt_ids) + int(np.flatnonzero(comp == tid)[-1]) + 1
    assert result.reward == ColourTask().reward(Sample(prompt=prompt, completion="r"))
    group = TrajectoryGroup(
        prompt_id=0, engine_id=0, prompt_tokens=np.asarray(prompt_ids, np.int32),
        completions=[comp.astype(np.int32)], logprobs=[np.asarray(result.logprobs, np.float32)], rewards=[result.reward],
        version_first=[0], version_last=[1], reward_status=[0], loss_masks=[mask.astype(np.uint8)],
        images=list(prompt.images), sample_images=[result.images],
    )
    _, (back,) = decode_groups(encode_groups("run", [group]), "run")
    assert back.images == list(prompt.images) and back.sample_images == [result.images]
    assert back.images_of(0) == list(prompt.images) + result.images


def test_an_image_after_a_sampled_placeholder_ends_the_episode_before_it_is_shown(vision, delta):
    """vLLM gives images to placeholders in order: one the policy sampled before an environment's image
    would take that image's features, so the image is not shown and the episode ends."""
    prompt = _prompt(1)
    _, result, seen, images = _episode(vision, delta, [[11, vision.image_token_id, 12]], prompt)
    assert result.finish_reason == "placeholder_sampled" and result.turns == 1 and result.images == []
    assert all(m == 1 for m in result.loss_mask) and images.images == []


def test_an_environment_turn_whose_images_do_not_fit_is_one_line(vision, delta):
    crop = zoomed(_prompt().images[0])
    with pytest.raises(ValueError, match=r"1 image\(s\) for 0 '<image>' marker\(s\)"):
        delta([ChatMessage("user", "look")], [crop])
    with pytest.raises(ValueError, match=r"holds 1 image placeholder tokens, its 0 image\(s\) make 0"):
        delta([ChatMessage("user", "a tool that prints <|image_pad|>")])
    with pytest.raises(ValueError, match="a turn's image: not a readable image"):
        delta([ChatMessage("user", "<image>look")], [b"not a png"])


def _episode_group(vision, delta, seed: int, turns_per_sample: list[list[list[int]]]) -> TrajectoryGroup:
    prompt = _prompt(seed)
    runs = [_episode(vision, delta, turns, prompt) for turns in turns_per_sample]
    prompt_ids = runs[0][0]
    results = [r for _, r, _, _ in runs]
    n = len(results)
    return TrajectoryGroup(
        prompt_id=seed, engine_id=0, prompt_tokens=np.asarray(prompt_ids, np.int32),
        completions=[np.asarray(r.completion_ids, np.int32) for r in results],
        logprobs=[np.asarray(r.logprobs, np.float32) for r in results], rewards=[r.reward for r in results],
        version_first=[0] * n, version_last=[0] * n, reward_status=[0] * n,
        loss_masks=[np.asarray(r.loss_mask, np.uint8) for r in results],
        images=list(prompt.images), sample_images=[r.images for r in results] if any(r.images for r in results) else None,
    )


def by_hand(model, ids, kinds, px):
    """The model's logits for one sequence with image features at `kinds` (1) only: HF's forward places them
    at every placeholder token, a sampled one too, so the reference embeds the sequence itself."""
    base = model.model
    embeds = base.get_input_embeddings()(ids)
    features = torch.cat(base.get_image_features(px.pixel_values, px.image_grid_thw, return_dict=True).pooler_output)
    mask = kinds.bool().unsqueeze(-1).expand_as(embeds)
    embeds = embeds.masked_scatter(mask, features.to(embeds.dtype))
    positions, _ = base.get_rope_index(ids, kinds, px.image_grid_thw)
    return model(inputs_embeds=embeds, position_ids=positions).logits


def test_the_learner_places_features_at_the_environments_placeholders_not_at_sampled_ones(vl_dir, vision, delta):
    """Two groups of zoom episodes, one episode of which samples the placeholder token in its second turn
    (text) and one of which ends before its crop; every layout equals the model's own forward of each
    sequence with only the prompt's and the environment's placeholders marked as images."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vl_dir).eval()
    tid = vision.image_token_id
    groups = [
        _episode_group(vision, delta, 0, [[[11, 12], [13, tid, tid, 14]], [[15], [16, 17]]]),
        _episode_group(vision, delta, 1, [[[18, tid], [19]], [[20, 21], [22]]]),  # the first ends before its crop
    ]
    inputs = VisionInputs(model, str(vl_dir), SETTINGS)
    want = []
    for g in groups:
        for i, c in enumerate(g.completions):
            ids = torch.tensor(np.concatenate([g.prompt_tokens, c]), dtype=torch.long)[None]
            kinds = (ids == tid).int()
            p = len(g.prompt_tokens)
            kinds[0, p:] *= torch.from_numpy(1 - g.loss_mask(i)).int()  # a sampled placeholder is text
            px = vision.pixels(g.images_of(i))
            assert int(kinds.sum()) == sum(px.tokens_per_image)
            with torch.no_grad():
                logits = by_hand(model, ids, kinds, px)
                if int(kinds.sum()) == int((ids == tid).sum()):  # no sampled placeholder: HF's own forward agrees
                    own = model(input_ids=ids, pixel_values=px.pixel_values, image_grid_thw=px.image_grid_thw,
                                mm_token_type_ids=kinds).logits
                    assert float((own - logits).abs().max()) < 1e-5
            lp = torch.log_softmax(logits[0].float(), -1)
            want.append(lp[p - 1 : -1].gather(1, torch.from_numpy(c).long()[:, None])[:, 0].numpy())
    samples = shard_samples(groups, vision=inputs)
    assert [s.vision.own for s in samples] == [True, True, False, True]
    assert samples[0].vision.span > len(groups[0].prompt_tokens)
    for name, mb in {"packed": packed(samples, 128), "padded": padded(samples), "shared": shared(samples, 128)}.items():
        with torch.no_grad():
            logp, _, _ = model_scores(model, mb.model_inputs(torch.device("cpu")), mb.targets, mb.span_index(), 1.0, 1024,
                                      entropy=False)
        err = max(float(np.abs(a - b).max()) for a, b in zip(mb.per_sequence(logp), want, strict=True))
        assert err < 1e-5, f"{name}: {err}"


def test_vision_settings_run_environments_and_refuse_agents_in_one_line(vl_dir):
    cfg = load_config(None, ["model.path=tiny-qwen2.5-vl", "task.name=colour", "env.name=zoom", "vision.max_images_per_prompt=2"])
    assert vision_error(cfg, True) is None
    agent = load_config(None, ["model.path=tiny-qwen2.5-vl", "env.name=agent:examples.calculator_agent:solve"])
    assert vision_error(agent, True) is None
    verifiers = load_config(None, ["model.path=tiny-qwen2.5-vl", "env.name=verifiers:vf-arith"])
    assert "verifiers environments with images are not tried yet" in vision_error(verifiers, True)
    assert "has no vision tower" in vision_error(load_config(None, ["env.name=zoom", "vision.max_images_per_prompt=2"]), False)
    from async_rl.errors import ConfigError

    with pytest.raises(ConfigError, match="env.name=zoom with vision.max_images_per_prompt=1"):
        load_config(None, ["model.path=tiny-qwen2.5-vl", "task.name=colour", "env.name=zoom"])


def test_a_samples_unreadable_image_is_a_counted_bad_frame():
    from async_rl.protocol import FrameError

    prompt = _prompt()
    g = TrajectoryGroup(
        prompt_id=3, engine_id=0, prompt_tokens=np.asarray([5, 6], np.int32), completions=[np.asarray([7, 8], np.int32)],
        logprobs=[np.zeros(2, np.float32)], rewards=[0.0], version_first=[0], version_last=[0], reward_status=[0],
        loss_masks=[np.asarray([1, 0], np.uint8)], images=list(prompt.images), sample_images=[[b"no png"]],
    )
    with pytest.raises(FrameError) as e:
        decode_groups(encode_groups("run", [g]), "run")
    assert e.value.reason == "bad_image" and "image 1 (6 bytes)" in str(e.value)
