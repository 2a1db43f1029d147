"""A micro-batch's images: pixel values in the order the model consumes them, and 3-D positions.

A vision-language model puts each image's features at the image placeholder tokens in the flattened
order of `input_ids` [B, T] (row by row, left to right). So a micro-batch's pixel values are its placed
prompts' images in that order: once per placed prompt, which under the shared-prompt layout is once per
block (one vision forward per group), and once per sequence otherwise.

A multi-turn episode whose environment showed images (`SampleVision.columns`) has its own images: its
prompt's, then its environment turns', each at its placeholders in the completion; such a sample is
never shared with another (`SampleVision.own`), so its images are placed once per sequence.

Models with multimodal rotary positions (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: 3-D positions, temporal,
height, width) get them per token from the 1-D positions the layout already gave (restarting at 0 for
every sequence, continuing after a shared prefix): a position p inside the stretch the model's own
`get_rope_index` covered (the prompt, or an episode's whole sequence when it has images of its own)
takes that 3-D position p, a position past it continues from the largest position + 1 on all three axes
(as `get_rope_index` counts text after the last image). Rows without images take p on all three axes.
The model receives [4, B, T]: the 1-D positions first (its packed-sequence mask reads them), then the
three axes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class SampleVision:
    """The images of one sample's prompt (shared by every sample of its group), or of one episode whose
    environment showed images too (`columns` set: its own)."""

    key: bytes  # digest of the prompt's image bytes: samples with equal tokens and key share a prompt
    pixel_values: torch.Tensor  # Qwen-VL [patches, patch_dim]; LLaVA [images, 3, height, width]
    image_grid_thw: torch.Tensor | None  # long [images, 3]; None: a fixed-size family's (LLaVA)
    # int64 [3, n]: the 3-D positions of the sequence's first n tokens (the prompt's, or with `columns` the
    # whole episode's); None: 1-D positions
    rope: np.ndarray | None
    image_token_id: int  # the placeholder token (inside the prompt: an image's; in a completion: text)
    images: tuple[bytes, ...] = ()  # the encoded files (the mismatch probe sends them to an engine)
    # An episode with images of its own: the columns (from the sequence's start) of every image
    # placeholder, the prompt's and the environment's (a placeholder the policy sampled is not one);
    # None: the prompt's placeholders, shared by its group
    columns: np.ndarray | None = None

    @property
    def own(self) -> bool:
        """Images of this sample alone (an episode's environment images): never a shared prompt's."""
        return self.columns is not None

    @property
    def span(self) -> int:
        """With `columns`: tokens up to the last image placeholder (every placeholder before it is an
        image's, which vLLM's prompt is cut back to: `PromptImages`); 0: the prompt."""
        return int(self.columns[-1]) + 1 if self.columns is not None and len(self.columns) else 0


@dataclass
class VisionBatch:
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor | None  # None: a fixed-size family's images (no grid)
    image_mask: torch.Tensor  # bool [B, T]: the placed prompts' placeholders (where the images' features go)
    rope: torch.Tensor | None  # long [3, B, T]

    def to(self, device: torch.device) -> VisionBatch:
        rope = None if self.rope is None else self.rope.to(device)
        grid = None if self.image_grid_thw is None else self.image_grid_thw.to(device)
        return VisionBatch(self.pixel_values.to(device), grid, self.image_mask.to(device), rope)


def rope_of(vision: SampleVision, positions: torch.Tensor) -> torch.Tensor:
    """long [3, n]: the 3-D positions of 1-D positions `positions` [n] of a sequence with `vision`'s images."""
    assert vision.rope is not None
    rope = torch.from_numpy(vision.rope)
    covered = rope.shape[1]
    inside = rope[:, positions.clamp(max=covered - 1)]
    after = (positions - covered + int(rope.max()) + 1).expand(3, -1)
    return torch.where(positions < covered, inside, after)


class VisionRows:
    """Collects the placed prompts of one micro-batch: `place` each stretch of columns that one prompt's
    images and positions cover (a sequence, or a shared-prompt block), then `build`."""

    def __init__(self) -> None:
        self._placed: list[tuple[int, int, int, int, SampleVision | None]] = []

    def place(self, row: int, start: int, end: int, prompt_len: int, vision: SampleVision | None) -> None:
        """Columns [start, end) of `row` hold one sequence (or block) whose first `prompt_len` tokens are a
        prompt with `vision`'s images (None: a text prompt)."""
        self._placed.append((row, start, end, start + prompt_len, vision))

    def build(self, positions: torch.Tensor, input_ids: torch.Tensor) -> VisionBatch | None:
        """The micro-batch's images, where they go, and 3-D positions, from its 1-D positions and token
        ids [B, T]; None: no images. A row's columns after its last stretch (its unused tail) continue
        that stretch's positions."""
        placed = sorted(self._placed, key=lambda p: (p[0], p[1]))
        seen = [v for *_, v in placed if v is not None]
        if not seen:
            return None
        pixels = torch.cat([v.pixel_values for v in seen])
        grids = [v.image_grid_thw for v in seen if v.image_grid_thw is not None]
        grid = torch.cat(grids) if grids else None  # one model's images: all with grids, or none
        mask = torch.zeros(input_ids.shape, dtype=torch.bool)
        for row, start, _, prompt_end, v in placed:
            if v is not None and v.columns is not None:
                mask[row, start + torch.from_numpy(v.columns)] = True
            elif v is not None:
                mask[row, start:prompt_end] = input_ids[row, start:prompt_end] == v.image_token_id
        rope = None
        if any(v.rope is not None for v in seen):
            rope = positions.unsqueeze(0).expand(3, -1, -1).clone()
            width = positions.shape[1]
            for i, (row, start, end, _, v) in enumerate(placed):
                last_in_row = i + 1 == len(placed) or placed[i + 1][0] != row
                stop = width if last_in_row else end
                if v is not None and v.rope is not None:
                    rope[:, row, start:stop] = rope_of(v, positions[row, start:stop])
        return VisionBatch(pixels, grid, mask, rope)
