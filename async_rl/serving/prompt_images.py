"""A vision-language engine's images: what it serves them with, and a prompt's images for vLLM."""

from __future__ import annotations

from typing import Any

import msgspec


class EngineImages(msgspec.Struct, frozen=True):
    """A vision-language engine's images: the placeholder token vLLM expands, the most images a prompt
    may hold (vLLM's limit_mm_per_prompt), and the processor's pixel bounds (vision.*: the learner's too)."""

    image_token_id: int
    max_images: int
    processor_kwargs: dict[str, int] = {}
    max_image_pixels: int = 0  # an environment's image larger than this is refused (vision.max_image_pixels; 0: no limit)

    def engine_args(self) -> dict[str, Any]:
        """vLLM's engine arguments for these images (no videos)."""
        return {
            "limit_mm_per_prompt": {"image": self.max_images, "video": 0},
            "mm_processor_kwargs": dict(self.processor_kwargs) or None,
        }


class PromptImages(msgspec.Struct):
    """A prompt's images as vLLM takes them (decoded), with the token that stands for each."""

    images: list[Any]  # PIL images, in prompt order
    image_token_id: int
    # A multi-turn episode's images: its first `span` tokens hold every image's placeholders (and no
    # placeholder the policy sampled); 0: the rendered prompt (`prompt_len`, or all the tokens)
    span: int = 0

    def tokens_prompt(self, token_ids: list[int], prompt_len: int = 0) -> Any:
        """vLLM's prompt: the rendered tokens with each image's expanded run of placeholders cut back
        to one, which vLLM expands again from the same pixels (`async_rl.vision`), and the images.
        `prompt_len` > 0: only the first `prompt_len` tokens are the rendered prompt; the rest (a
        completion so far, scored or continued) stays as it is, a sampled placeholder token being text
        to vLLM (it expands only the first placeholder of each image, in order: so every image's
        placeholders must come before any sampled one, which `span` marks for an episode)."""
        from vllm.inputs import TokensPrompt

        from async_rl.vision import collapse

        cut = self.span or prompt_len or len(token_ids)
        ids = collapse(list(token_ids[:cut]), self.image_token_id) + list(token_ids[cut:])
        return TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": self.images})


def prompt_images(images: list[bytes], spec: EngineImages | None, span: int = 0) -> PromptImages | None:
    """A prompt's encoded images decoded for vLLM (None: no images). Images for an engine that serves
    no vision-language model: ValueError (the renderer refuses such prompts before they are leased).
    `span`: an episode's tokens up to its last image's placeholders (`PromptImages.span`)."""
    if not images:
        return None
    if spec is None:
        raise ValueError(f"a prompt with {len(images)} image(s) for a model without a vision tower")
    from async_rl.images import decode

    return PromptImages([decode(b) for b in images], spec.image_token_id, span)
