"""'zoom': a two-turn visual environment for vision-language models (the `colour` task and the like).

The model answers from the prompt's image; the environment then shows it a closer look (the part of
the image that is not background, cropped and scaled to the image's size: a tool's crop) with the
prompt's text again, and the model answers once more. The task's reward scores the last answer. It
is the smallest episode in which an environment's image reaches the model's next turn, so the path
(engine, frame, learner) is tested on CPU with the tiny preset; it asks nothing of the model's tools.
"""

from __future__ import annotations

import inspect

from async_rl.envs.base import Environment, EnvTurn, Episode
from async_rl.envs.tool_env import RewardFn
from async_rl.images import IMAGE_MARKER, decode, encode_png
from async_rl.protocol import ChatMessage, Prompt, Sample


def zoomed(data: bytes) -> bytes:
    """The image's non-black part (its whole when all black) scaled back to the image's size, as PNG."""
    image = decode(data)
    box = image.getbbox() or (0, 0, *image.size)
    return encode_png(image.crop(box).resize(image.size))


class ZoomEpisode(Episode):
    def __init__(self, prompt: Prompt, reward: RewardFn) -> None:
        self.prompt = prompt
        self.reward = reward
        self.shown = False

    async def step(self, model_text: str, finished: bool) -> EnvTurn:
        if self.shown or not self.prompt.images:  # the closer look was given (or there is no image)
            return EnvTurn(done=True)
        self.shown = True
        text = self.prompt.text.replace(IMAGE_MARKER, "").strip()
        return EnvTurn(
            messages=[ChatMessage("user", f"{IMAGE_MARKER}closer look. {text}")], images=[zoomed(self.prompt.images[0])]
        )

    async def final_reward(self, transcript: list[ChatMessage]) -> float:
        answer = next((m.content for m in reversed(transcript) if m.role == "assistant"), "")
        value = self.reward(Sample(prompt=self.prompt, completion=answer))
        if inspect.isawaitable(value):
            value = await value
        return float(value)


class ZoomEnvironment(Environment):
    name = "zoom"

    def __init__(self, reward: RewardFn) -> None:
        self.reward = reward

    def start(self, prompt: Prompt) -> Episode:
        return ZoomEpisode(prompt, self.reward)
