"""The learner's side of a vision-language model: a group's images -> what its samples carry.

The group's images arrive as the encoded files the engine read (`TrajectoryGroup.images`); the
processor (`async_rl.vision`, loaded from the same folder with the same `vision.*` pixel bounds as the
engine's) turns them into pixel values and grids. The prompt's tokens must hold exactly as many image
tokens as those grids make: otherwise the engine saw other pixels, and the step stops in one line.
Qwen-VL families also get their prompt's 3-D rotary positions from the model's own `get_rope_index`
(`VisionFamily.rope_3d`); LLaVA's prompts keep the layout's 1-D positions.

An episode whose environment showed images (a tool's crop: `TrajectoryGroup.sample_images`) has images
of its own: its features go at the prompt's placeholders and at the placeholders of its environment
turns (loss mask 0), never at one the policy sampled, and `get_rope_index` covers its whole sequence
with only those marked as images (`of_sample`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import torch

from async_rl.config import VisionConfig
from async_rl.errors import RunError
from async_rl.learner.batch.vision_rows import SampleVision
from async_rl.protocol import TrajectoryGroup
from async_rl.vision import VisionModel
from async_rl.vision_family import VisionFamily

_CACHE_GROUPS = 4096  # a step's groups are scored, then trained: process each group's images once


def images_key(images: list[bytes]) -> bytes:
    """A digest of a prompt's images (length-prefixed, so that no two lists share one)."""
    h = hashlib.blake2b(digest_size=16)
    for data in images:
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


class VisionInputs:
    def __init__(self, model: torch.nn.Module, model_dir: str, settings: VisionConfig) -> None:
        self.vision = VisionModel(model_dir, settings)
        # Qwen2-VL, Qwen2.5-VL: 3-D positions from the model itself (its base model's); LLaVA: 1-D
        self._rope_index = model.base_model.get_rope_index if self.vision.family.rope_3d else None
        self._cache: dict[tuple[bytes, bytes], SampleVision] = {}

    def of_sample(self, group: TrajectoryGroup, i: int) -> SampleVision | None:
        """The images of `group`'s sample i: its own (`of_episode`) when it has any, else its group's."""
        if group.sample_images is not None and group.sample_images[i]:
            return self.of_episode(group, i)
        return self.of(group)

    def of_episode(self, group: TrajectoryGroup, i: int) -> SampleVision:
        """Sample i's images, the group's then its own, at the prompt's placeholders and at those of the
        completion's environment tokens; its 3-D positions over the whole sequence."""
        images = group.images_of(i)
        completion = np.asarray(group.completions[i], dtype=np.int64)
        tokens = np.concatenate([np.asarray(group.prompt_tokens, dtype=np.int64), completion])
        image_id = self.vision.image_token_id
        in_prompt = np.flatnonzero(tokens[: len(group.prompt_tokens)] == image_id)
        env = (completion == image_id) & (group.loss_mask(i) == 0)  # a sampled placeholder stays text
        columns = np.concatenate([in_prompt, len(group.prompt_tokens) + np.flatnonzero(env)])
        pixels = self.vision.pixels(images)
        want = sum(pixels.tokens_per_image)
        if len(columns) != want:
            raise RunError(
                f"prompt {group.prompt_id} sample {i} (engine {group.engine_id}): its prompt and environment turns hold "
                f"{len(columns)} image tokens, its {len(images)} image(s) make {want} here: the engine processed other "
                "pixels (vision.min_pixels/max_pixels)"
            )
        rope = None
        if self._rope_index is not None:
            ids = torch.from_numpy(tokens).unsqueeze(0)
            kinds = torch.zeros_like(ids, dtype=torch.int32)
            kinds[0, torch.from_numpy(columns)] = 1  # 1: an image token (the policy's own placeholders: text)
            positions, _ = self._rope_index(ids, kinds, pixels.image_grid_thw)
            rope = positions[:, 0].to(torch.int64).numpy().copy()
        key = images_key(images) + completion.tobytes()
        return SampleVision(key, pixels.pixel_values, pixels.image_grid_thw, rope, image_id, tuple(images), columns)

    def of(self, group: TrajectoryGroup) -> SampleVision | None:
        """The images of `group`'s prompt for its samples (None: a text prompt)."""
        if not group.images:
            return None
        tokens = np.asarray(group.prompt_tokens, dtype=np.int64)
        key = (images_key(group.images), tokens.tobytes())
        if (hit := self._cache.get(key)) is not None:
            return hit
        pixels = self.vision.pixels(group.images)
        have, want = self.vision.image_tokens(tokens), sum(pixels.tokens_per_image)
        if have != want:
            raise RunError(
                f"prompt {group.prompt_id} (engine {group.engine_id}): its tokens hold {have} image tokens, its "
                f"{len(group.images)} image(s) make {want} here: the engine processed other pixels (vision.min_pixels/max_pixels)"
            )
        rope = None
        if self._rope_index is not None:
            ids = torch.from_numpy(tokens).unsqueeze(0)
            kinds = (ids == self.vision.image_token_id).int()  # 1: an image token
            positions, _ = self._rope_index(ids, kinds, pixels.image_grid_thw)
            rope = positions[:, 0].to(torch.int64).numpy().copy()
        out = SampleVision(key[0], pixels.pixel_values, pixels.image_grid_thw, rope, self.vision.image_token_id,
                           tuple(group.images))
        if len(self._cache) >= _CACHE_GROUPS:
            self._cache.clear()
        self._cache[key] = out
        return out


def frozen_vision_tower(model: torch.nn.Module, family: VisionFamily) -> int:
    """learner.freeze_vision: the vision tower's parameters stop requiring grad, but for its projector
    (Qwen-VL: `visual.merger`; LLaVA: `multi_modal_projector`, outside the tower); returns how many froze."""
    frozen = 0
    for name, p in model.named_parameters():
        if family.in_tower(name):
            p.requires_grad_(False)
            frozen += 1
    if not frozen:
        raise RunError(f"learner.freeze_vision: the {family.name} model names no vision tower {family.tower}: set it false")
    return frozen


def unused_tower_weights(model: torch.nn.Module, family: VisionFamily) -> Callable[[str], bool]:
    """Whether a weight (its HF name) is one the model never uses: a tower that reads the features of an
    inner layer (LLaVA's `vision_feature_layer`, -2: the second-to-last) never uses the layers after it,
    nor its final norm, and vLLM does not load them, so the served checksum leaves them out."""
    if not family.feature_layer:
        return lambda name: False
    config = model.config
    layers = int(config.vision_config.num_hidden_layers)
    chosen = config.vision_feature_layer
    # hidden_states[i] is the output of layer i - 1 (0: the embeddings): layers from the deepest one read on are unused
    deepest = max(i if i >= 0 else layers + 1 + i for i in (chosen if isinstance(chosen, list) else [chosen]))
    unused = tuple(f".{family.tower[0]}.encoder.layers.{i}." for i in range(deepest, layers))
    unused += (f".{family.tower[0]}.post_layernorm.",)
    return lambda name: any(u in f".{name}" for u in unused)
