"""An environment turn with images, as a vision-language model's tokens.

`ChatDelta` renders an environment turn's messages after a finished assistant turn with the tokenizer's
chat template. A vision-language model's turn may hold images (`EnvTurn.images`, one per `<image>`
marker): its processor renders them as content parts and expands each image's placeholder to that
image's tokens at the run's pixel bounds, exactly as the prompt source renders a prompt (`vision.py`),
so the engine and the learner count the same tokens for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from async_rl.envs.episode import ChatDelta
from async_rl.images import IMAGE_MARKER
from async_rl.protocol import ChatMessage
from async_rl.vision import VisionModel, marked_parts


class VisionChatDelta(ChatDelta):
    """`ChatDelta` through a vision-language model's processor (its tokenizer's template, images expanded)."""

    def __init__(self, vision: VisionModel, end_of_turn_id: int, max_image_pixels: int) -> None:
        self.vision = vision
        self.max_image_pixels = max_image_pixels
        self._images: Sequence[bytes] = ()
        # open turns: the tiny preset's template has no roles (a real VLM's, Qwen's, ends its turns)
        super().__init__(vision.processor.tokenizer, end_of_turn_id, open_turns=True)

    @classmethod
    def for_vision(cls, vision: VisionModel, stop_ids: list[int], max_image_pixels: int, who: str) -> VisionChatDelta:
        """The delta whose end-of-turn token is the first of the model's stop tokens its template ends an
        assistant turn with (as `ChatDelta.for_model`)."""
        from async_rl.envs.episode import first_that_renders

        return first_that_renders(lambda token: cls(vision, token, max_image_pixels), stop_ids, who)

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        parts = [{"role": m["role"], "content": marked_parts(m["content"])} for m in messages]
        return self.vision.tokens(parts, list(self._images), add_generation_prompt)

    def __call__(self, messages: Sequence[ChatMessage], images: Sequence[bytes] = ()) -> list[int]:
        """The turn's tokens; ValueError (one line) when its `<image>` markers and images disagree, an
        image is unusable, or its text holds image placeholders of its own."""
        from async_rl.images import ImageError, check

        markers = sum(m.content.count(IMAGE_MARKER) for m in messages)
        if markers != len(images):
            raise ValueError(f"a turn with {len(images)} image(s) for {markers} '{IMAGE_MARKER}' marker(s)")
        try:
            for data in images:
                check(data, self.max_image_pixels)
            self._images = images
            try:
                delta = super().__call__(messages)
            finally:
                self._images = ()
            want = sum(self.vision.pixels(list(images)).tokens_per_image) if images else 0
        except ImageError as exc:
            raise ValueError(f"a turn's image: {exc}") from None
        have = self.vision.image_tokens(delta)
        if have != want:  # e.g. a tool's text that spells the placeholder token: it would pass for an image
            raise ValueError(f"a turn holds {have} image placeholder tokens, its {len(images)} image(s) make {want}")
        return delta
