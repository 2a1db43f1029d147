"""A vision-language forward with the images placed where the prompts put them, and nowhere else.

Hugging Face's VLM forward puts image features at every image placeholder token of `input_ids`. A
policy may sample that token in a completion (a random model does, 1 in ~50 tokens; a trained one
rarely), and vLLM embeds a sampled one as text: it places features only at the prompt's placeholders,
whose offsets it tracks. So the learner builds the input embeddings itself: the token embeddings, with
the images' features scattered at the placed prompts' placeholders only (`VisionBatch.image_mask`),
and runs the model on `inputs_embeds`; the 3-D positions (Qwen-VL) come with the inputs. A family whose
processor gives each image's grid (Qwen-VL: `image_grid_thw`) hands the grid to the vision tower with the
pixels; a fixed-size family's (LLaVA's) micro-batch carries no grid, and its tower takes the pixels alone.

Qwen3-VL's DeepStack: its tower also gives features of inner blocks, which the language model adds to
its first layers' hidden states at the image tokens. HF's Qwen3VLModel.forward finds those tokens in
`input_ids` (every placeholder, sampled ones too) and passes no DeepStack features with `inputs_embeds`
alone, so the learner hands them to the language model itself, at the same prompt placeholders
(`visual_pos_masks`, `deepstack_visual_embeds`), and runs that language model as the trunk (`trunk`):
with 3-D positions given, the wrapper would do nothing else.
"""

from __future__ import annotations

import torch

from async_rl.errors import RunError

IMAGE_KEYS = ("pixel_values", "image_grid_thw", "image_mask")
DEEPSTACK_KEYS = ("visual_pos_masks", "deepstack_visual_embeds")  # Qwen3-VL's language model takes them


def with_image_embeds(model: torch.nn.Module, inputs: dict) -> dict:
    """`inputs` (the HF forward's keyword arguments) with `input_ids` and the images replaced by
    `inputs_embeds`; unchanged when they hold no images."""
    if "image_mask" not in inputs:
        return inputs
    inputs = dict(inputs)
    pixel_values, grid, mask = (inputs.pop(k, None) for k in IMAGE_KEYS)
    base = model.base_model
    embeds = base.get_input_embeddings()(inputs.pop("input_ids"))
    tower = {"pixel_values": pixel_values} if grid is None else {"pixel_values": pixel_values, "image_grid_thw": grid}
    out = base.get_image_features(**tower, return_dict=True)
    features = torch.cat(out.pooler_output)
    if features.shape[0] != int(mask.sum()):
        raise RunError(f"{features.shape[0]} image features for {int(mask.sum())} image placeholders of the micro-batch")
    embeds = embeds.masked_scatter(mask.unsqueeze(-1).expand_as(embeds), features.to(embeds.dtype))
    inputs["inputs_embeds"] = embeds
    if deepstack := getattr(out, "deepstack_features", None):  # per tower level, per image: in placeholder order
        inputs["visual_pos_masks"] = mask
        inputs["deepstack_visual_embeds"] = [torch.cat(level).to(embeds.dtype) for level in deepstack]
    return inputs


def trunk(model: torch.nn.Module, inputs: dict) -> torch.nn.Module:
    """The module whose forward takes `inputs` (after `with_image_embeds`) and returns the last hidden
    states: the base model, or with DeepStack features its language model (the base model would pass
    its own, none, beside them)."""
    return model.base_model.language_model if DEEPSTACK_KEYS[0] in inputs else model.base_model
