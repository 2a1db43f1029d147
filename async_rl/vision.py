"""A vision-language model's processor, the one object that turns images into tokens and pixels.

The prompt source renders a prompt with images through it (the chat template, then every image's
placeholder expanded to that image's tokens); the engine hands vLLM the prompt with each image's run of
placeholder tokens collapsed back to one (`collapse`: vLLM expands it again, from the same pixels and
the same bounds, and the engine checks that it got the rendered tokens back); the learner asks it for
the pixel values and grid of the group's images (`pixels`). Engine and learner load it from the same
model folder with the same pixel bounds (`vision.min_pixels`/`max_pixels`), so the learner's pixels
are the engine's: the token count each image expands to is checked on both sides.

A folder whose config.json has a `vision_config` is a vision-language model; it must carry its
processor (processor_config.json or preprocessor_config.json) beside the weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from async_rl.config import VisionConfig
from async_rl.errors import RunError, first_line
from async_rl.images import IMAGE_MARKER, ImageError, check, decode
from async_rl.vision_family import VisionFamily, family_error, family_of, model_type

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def _config(model_dir: str | Path) -> dict:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def is_vision_model(model_dir: str | Path) -> bool:
    """Whether the HF folder's config.json describes a vision-language model (has a vision_config)."""
    return "vision_config" in _config(model_dir)


def image_token_id(model_dir: str | Path) -> int:
    """The placeholder token id a vision-language model's config.json names (Qwen: image_token_id,
    LLaVA: image_token_index), read without loading the processor; -1 when it names none."""
    config = _config(model_dir)
    value = config.get("image_token_id", config.get("image_token_index"))
    return int(value) if isinstance(value, int) else -1


@dataclass
class Pixels:
    """A group's images as the learner's forward takes them."""

    # torch.Tensor, the images back to back: Qwen [patches, patch_dim]; LLaVA [images, 3, height, width]
    pixel_values: Any
    # torch.LongTensor [images, 3]: each image's (frames, rows, columns) of patches; None: a family whose
    # images all have one size (`VisionFamily.image_grid`)
    image_grid_thw: Any
    tokens_per_image: list[int]  # each image's placeholder tokens (Qwen's: after the merger)


class VisionModel:
    def __init__(self, model_dir: str | Path, settings: VisionConfig) -> None:
        from transformers import AutoProcessor

        self.model_dir = str(model_dir)
        self.settings = settings
        kind = model_type(model_dir)
        family = family_of(kind)
        if family is None:
            raise RunError(family_error(kind, self.model_dir))
        self.family: VisionFamily = family
        if not any((Path(model_dir) / f).is_file() for f in PROCESSOR_FILES):
            raise RunError(
                f"model '{model_dir}' is a vision-language model without a processor (no {' or '.join(PROCESSOR_FILES)})"
            )
        try:
            self.processor = AutoProcessor.from_pretrained(self.model_dir, **self.processor_kwargs())
        except Exception as exc:  # noqa: BLE001 (any loader error: named in one line)
            raise RunError(f"model '{model_dir}': its processor does not load: {first_line(exc)}") from None
        tokenizer = self.processor.tokenizer
        self.image_token = getattr(self.processor, "image_token", None) or "<image>"
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(self.image_token))
        self.merge = int(getattr(self.processor.image_processor, "merge_size", 1) or 1)
        # a fixed-size family: every image makes the tokens one image makes (counted by the processor itself)
        self._fixed_tokens = 0 if family.image_grid else self._tokens_of_one_image()

    def processor_kwargs(self) -> dict[str, int]:
        """The run's pixel bounds for a family whose processor takes them (the launcher refuses them for
        the others: `vision_settings.family_settings_error`)."""
        return self.settings.processor_kwargs() if self.family.pixel_bounds else {}

    def _tokens_of_one_image(self) -> int:
        from PIL import Image

        out = self.processor(text=[self.image_token], images=[Image.new("RGB", (8, 8))], return_tensors="np")
        return self.image_tokens(out["input_ids"][0])

    @classmethod
    def of(cls, model_dir: str | Path, settings: VisionConfig) -> VisionModel | None:
        """The model's VisionModel, or None for a text-only model."""
        return cls(model_dir, settings) if is_vision_model(model_dir) else None

    def render(self, chat: list[tuple[str, str]], images: list[bytes], max_image_pixels: int) -> list[int]:
        """The token ids of a chat whose messages mark images with `<image>` (none: all before the first
        user message's text), each image's placeholder expanded. ImageError: an unusable image."""
        for data in images:
            check(data, max_image_pixels)
        marked = any(IMAGE_MARKER in content for _, content in chat)
        messages, placed = [], False
        for role, content in chat:
            parts: list[dict[str, str]] = []
            if not marked and not placed and role == "user":
                parts += [{"type": "image"} for _ in images]
                placed = True
            parts += marked_parts(content)
            messages.append({"role": role, "content": parts})
        if not marked and not placed:
            raise ImageError("image_count", f"{len(images)} image(s) but the prompt has no user message to hold them")
        return self.tokens(messages, images, add_generation_prompt=True)

    def tokens(self, messages: list[dict], images: list[bytes], add_generation_prompt: bool, **template_kwargs) -> list[int]:
        """Template messages (content parts, `{"type": "image"}` for each of `images` in order) as token
        ids, each image's placeholder expanded. ImageError: an unusable image, a refused template.
        `template_kwargs`: the chat template's own (tools)."""
        pils = [decode(data) for data in images]
        try:
            text = self.processor.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs
            )
            out = self.processor(text=[text], images=pils or None, return_tensors="np")
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise ImageError("template_error", f"the processor refused the prompt: {first_line(exc)}") from None
        return [int(t) for t in out["input_ids"][0]]

    def pixels(self, images: list[bytes]) -> Pixels:
        """The learner's pixels of a group's images (the engine's: same bytes, same processor, same bounds)."""
        import torch

        out = self.processor.image_processor(images=[decode(data) for data in images], return_tensors="pt")
        if not self.family.image_grid:
            return Pixels(torch.as_tensor(out["pixel_values"]), None, [self._fixed_tokens] * len(images))
        grid = torch.as_tensor(out["image_grid_thw"], dtype=torch.long)
        per_image = [int(g.prod()) // (self.merge * self.merge) for g in grid]
        return Pixels(torch.as_tensor(out["pixel_values"]), grid, per_image)

    def image_tokens(self, token_ids: np.ndarray | list[int]) -> int:
        """How many image placeholder tokens a token sequence holds."""
        return int(np.count_nonzero(np.asarray(token_ids) == self.image_token_id))


def marked_parts(content: str) -> list[dict[str, str]]:
    """A message's text as content parts: an image part at each `<image>` marker, text between them."""
    parts: list[dict[str, str]] = []
    for i, piece in enumerate(content.split(IMAGE_MARKER)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def collapse(token_ids: list[int], image_token_id: int) -> list[int]:
    """Every run of `image_token_id` cut to one token: the prompt as vLLM takes it with its images
    (vLLM expands each placeholder to its image's tokens itself)."""
    out: list[int] = []
    for t in token_ids:
        if t == image_token_id and out and out[-1] == image_token_id:
            continue
        out.append(t)
    return out
