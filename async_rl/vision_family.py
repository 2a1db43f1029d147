"""The vision-language families async_rl trains, each described by what differs between them.

A family is chosen by the `model_type` of the model folder's config.json, never by probing the loaded
model's attributes: what the learner does with a family's images is written down here, in one place,
and a family not listed is refused in one line before anything starts (docs/vision.md).

- Qwen2-VL, Qwen2.5-VL: the processor resizes each image within the run's pixel bounds
  (`vision.min_pixels`/`max_pixels`) and gives each image's patch grid (`image_grid_thw`, which the
  vision tower takes with the pixels); 3-D rotary positions from the model's own `get_rope_index`; the
  tower is `visual`, whose patch merger (`visual.merger`) is the projector that trains.
- Qwen3-VL: as Qwen2.5-VL (16-pixel patches, its own `get_rope_index`), and DeepStack: mergers that take
  the features of inner tower blocks, whose outputs the language model adds to its first layers' hidden
  states at the image tokens; they train with the patch merger (`visual.deepstack_merger_list`, vLLM's
  connector too), and the learner hands them to the language model itself where its tower gives them
  (`learner/model/vision_embed.py`).
- LLaVA: the processor resizes and crops every image to one fixed size (no grid, no pixel bounds: every
  image makes the same number of tokens); plain 1-D positions; the tower is `vision_tower`, the
  projector (`multi_modal_projector`) lies outside it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class VisionFamily:
    name: str  # what the docs and errors call it
    model_types: tuple[str, ...]  # config.json's model_type
    rope_3d: bool  # multimodal rotary positions from `get_rope_index`; False: the layout's 1-D positions
    image_grid: bool  # the processor gives each image's grid (`image_grid_thw`), which the tower takes too
    pixel_bounds: bool  # the processor takes vision.min_pixels/max_pixels; False: one fixed image size
    tower: tuple[str, ...]  # module names whose parameters are the vision tower (learner.freeze_vision)
    projector: tuple[str, ...] = ()  # modules inside the tower that train anyway (Qwen's patch merger)
    # Whether the tower may train (learner.freeze_vision=false): its weights' names in the learner are the
    # ones vLLM loads. LLaVA's are not: transformers 5's CLIP tower drops the `vision_model.` level.
    tower_trains: bool = True
    # The tower's features come from an inner layer (LLaVA's config.vision_feature_layer): the layers after
    # it and the final norm are never used (and vLLM does not load them)
    feature_layer: bool = False

    def in_tower(self, parameter: str) -> bool:
        """Whether parameter `parameter` (a full name) is the vision tower's and not its projector's."""
        parts = f".{parameter}."
        return any(f".{t}." in parts for t in self.tower) and not any(f".{p}." in parts for p in self.projector)


QWEN_VL = VisionFamily("Qwen2-VL/Qwen2.5-VL", ("qwen2_vl", "qwen2_5_vl"), rope_3d=True, image_grid=True,
                       pixel_bounds=True, tower=("visual",), projector=("visual.merger",))
QWEN3_VL = VisionFamily("Qwen3-VL", ("qwen3_vl",), rope_3d=True, image_grid=True, pixel_bounds=True, tower=("visual",),
                        projector=("visual.merger", "visual.deepstack_merger_list"))
LLAVA = VisionFamily("LLaVA", ("llava",), rope_3d=False, image_grid=False, pixel_bounds=False, tower=("vision_tower",),
                     tower_trains=False, feature_layer=True)
FAMILIES = (QWEN_VL, QWEN3_VL, LLAVA)
SUPPORTED = tuple(t for f in FAMILIES for t in f.model_types)


def model_type(model_dir: str | Path) -> str:
    """config.json's model_type ('' when unreadable)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    return str(config.get("model_type", "")) if isinstance(config, dict) else ""


def family_of(kind: str) -> VisionFamily | None:
    """The family of a vision-language model of model_type `kind`; None: not one async_rl trains."""
    return next((f for f in FAMILIES if kind in f.model_types), None)


def family_error(kind: str, path: str) -> str | None:
    """The one line that refuses a vision-language model of model_type `kind` at `path`, or None."""
    if family_of(kind) is not None:
        return None
    return (f"model.path '{path}' is a vision-language model of type '{kind or 'unknown'}', not built yet: "
            f"async_rl trains {', '.join(SUPPORTED)} (docs/vision.md)")
