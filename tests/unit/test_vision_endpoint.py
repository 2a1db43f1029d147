"""OpenAI image_url content parts through the agents' endpoint, for the tiny Qwen2.5-VL preset (no vLLM:
the model behind the endpoint is scripted). A data URL's image reaches the engine with the call's
tokens; a spliced follow-up call that adds an image keeps every image so far; the episode's segment
carries them with the environment's placeholders masked; bad parts are one-line 400s naming the part."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import numpy as np
import openai
import pytest

from async_rl.agents.runner import data_url, job_prompt
from async_rl.config import VisionConfig
from async_rl.endpoint.endpoint import CallImages, CallSampling, ChatEndpoint, ModelBackend
from async_rl.endpoint.episode_log import Choice, build_segments
from async_rl.endpoint.rendering import ChatRenderer
from async_rl.envs.zoom import zoomed
from async_rl.models.tiny import resolve_model_path
from async_rl.protocol import ChatMessage
from async_rl.serving.sampling import SamplingSpec
from async_rl.tasks.colour import ColourTask
from async_rl.vision import VisionModel

KEY = "test-key"
EOS = 1


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> Path:
    return resolve_model_path("tiny-qwen2.5-vl", str(tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="module")
def vision(vl_dir) -> VisionModel:
    return VisionModel(vl_dir, VisionConfig())


class ScriptedVision(ModelBackend):
    """Answers each call with the next scripted token ids (EOS appended); records what it was given."""

    def __init__(self, script: list[list[int]]) -> None:
        self.script = list(script)
        self.model_name = "scripted-vl"
        self.max_model_len = 512
        self.calls: list[tuple[list[int], CallImages | None]] = []

    async def complete(self, prompt_ids: list[int], base: SamplingSpec, call: CallSampling, request_id: str,
                       images: CallImages | None = None) -> list[Choice]:
        self.calls.append((list(prompt_ids), images))
        ids = (self.script.pop(0) if self.script else [12]) + [EOS]
        return [Choice(token_ids=ids, logprobs=[-0.5] * len(ids), text="r", finish_reason="stop", version_first=0, version_last=0)]


def serve(vision, script: list[list[int]]) -> tuple[ChatEndpoint, ScriptedVision]:
    model = ScriptedVision(script)
    renderer = ChatRenderer(vision.processor.tokenizer, EOS, vision, 4096 * 4096)
    return ChatEndpoint(model, renderer, KEY, max_images=2), model


def _images() -> tuple[bytes, bytes]:
    picture = next(iter(ColourTask().prompts(0))).images[0]
    return picture, zoomed(picture)


def _sampling() -> SamplingSpec:
    return SamplingSpec(n=1, max_tokens=8, temperature=1.0, stop_token_ids=[EOS])


def test_image_parts_reach_the_engine_and_a_follow_up_keeps_every_image(vision):
    picture, crop = _images()
    tid = vision.image_token_id

    async def go():
        endpoint, model = serve(vision, [[12, 13], [14]])
        await endpoint.start()
        log = endpoint.open_episode("ep", _sampling(), 4)
        try:
            client = openai.AsyncOpenAI(base_url=endpoint.base_url("ep"), api_key=KEY, max_retries=0)
            messages = [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(picture)}}, {"type": "text", "text": "colour:"}]}]
            first = await client.chat.completions.create(model="m", messages=messages)
            messages += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(crop)}},
                                                      {"type": "text", "text": "closer look. colour:"}]}]
            await client.chat.completions.create(model="m", messages=messages)
        finally:
            await endpoint.stop()
        return model, endpoint.close_episode("ep") if "ep" in endpoint.episodes else log

    model, log = asyncio.run(go())
    (p1, im1), (p2, im2) = model.calls
    assert im1.images == [picture] and p1.count(tid) == 4 and im1.span == len(p1) - p1[::-1].index(tid)
    # spliced: the first prompt, the sampled ids, then only the new message with its crop
    assert p2[: len(p1) + 3] == p1 + [12, 13, EOS] and im2.images == [picture, crop] and p2.count(tid) == 8
    assert im2.span == len(p2) - p2[::-1].index(tid)
    (seg,) = build_segments(log.calls)
    assert seg.images == [picture, crop]
    comp, mask = np.asarray(seg.completion_ids), np.asarray(seg.loss_mask)
    assert int((comp[mask == 0] == tid).sum()) == 4 and int((comp[mask == 1] == tid).sum()) == 0


@pytest.mark.parametrize(
    ("part", "words"),
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
         "messages[0].content[1]: image_url must be a data URL (data:image/png;base64,...), not 'https': the endpoint fetches nothing"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}},
         "messages[0].content[1]: the data URL's payload is not base64"),
        ({"type": "image_url", "image_url": {"url": "data:image/png," + "x" * 8}},
         "messages[0].content[1]: a data URL needs ';base64,' before its bytes"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"no png").decode()}},
         "messages[0].content[1]: not a readable image (6 bytes)"),
    ],
)
def test_a_bad_image_part_is_a_one_line_400_naming_the_message_and_part(vision, part, words):
    async def go():
        endpoint, model = serve(vision, [])
        await endpoint.start()
        endpoint.open_episode("ep", _sampling(), 4)
        try:
            client = openai.AsyncOpenAI(base_url=endpoint.base_url("ep"), api_key=KEY, max_retries=0)
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": [{"type": "text", "text": "colour:"}, part]}])
            return e.value, model
        finally:
            await endpoint.stop()

    err, model = asyncio.run(go())
    message = err.body["message"]
    assert words in message and "\n" not in message and not model.calls


def test_an_image_after_a_reply_that_sampled_the_placeholder_is_rendered_whole_as_a_new_segment(vision):
    """vLLM gives images to placeholders in order: a follow-up that adds an image after a reply holding a
    sampled placeholder is not spliced onto the sampled ids but rendered whole (the reply's text has no
    such token), a prefix break; each segment keeps the images its calls were generated with."""
    picture, crop = _images()
    tid = vision.image_token_id

    async def go():
        endpoint, model = serve(vision, [[12, tid]])
        await endpoint.start()
        endpoint.open_episode("ep", _sampling(), 4)
        try:
            client = openai.AsyncOpenAI(base_url=endpoint.base_url("ep"), api_key=KEY, max_retries=0)
            messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(picture)}}]}]
            first = await client.chat.completions.create(model="m", messages=messages)
            messages += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(crop)}}]}]
            await client.chat.completions.create(model="m", messages=messages)
            return model, endpoint.close_episode("ep")
        finally:
            await endpoint.stop()

    model, log = asyncio.run(go())
    (p1, _), (p2, im2) = model.calls
    assert p2[: len(p1) + 3] != p1 + [12, tid, EOS] and im2.images == [picture, crop] and p2.count(tid) == 8
    first, second = build_segments(log.calls)
    assert first.images == [picture] and second.images == [picture, crop]
    assert first.completion_ids == [12, tid, EOS]  # the sampled placeholder stays in its own segment, as text


def test_an_agents_prompt_holds_the_prompts_images_as_data_urls():
    picture, _ = _images()
    (msg,) = job_prompt([ChatMessage("user", "<image>colour:")], [picture])
    assert msg["content"][0]["image_url"]["url"] == data_url(picture) and msg["content"][1] == {"type": "text", "text": "colour:"}
    assert data_url(picture).startswith("data:image/png;base64,")
    assert job_prompt([ChatMessage("user", "hi")]) == [{"role": "user", "content": "hi"}]
