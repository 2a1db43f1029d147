"""A vision-language forward with the images placed where the prompts put them, and nowhere else.

Hugging Face's VLM forward puts image features at every image placeholder token of `input_ids`. A
policy may sample that token in a completion (a random model does, 1 in ~50 tokens; a trained one
rarely), and vLLM embeds a sampled one as text: it places features only at the prompt's placeholders,
whose offsets it tracks. So the learner builds the input embeddings itself: the token embeddings, with
the images' features scattered at the placed prompts' placeholders only (`VisionBatch.image_mask`),
and runs the model on `inputs_embeds`; the 3-D positions (Qwen-VL) come with the inputs. A family whose
processor gives each image's grid (Qwen-VL: `image_grid_thw`) hands the grid to the vision tower with the
pixels; a fixed-size family's (LLaVA's) micro-batch carries no grid, and its tower takes the pixels alone.
"""

from __future__ import annotations

import torch

from async_rl.errors import RunError

IMAGE_KEYS = ("pixel_values", "image_grid_thw", "image_mask")


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
    features = torch.cat(base.get_image_features(**tower, return_dict=True).pooler_output)
    if features.shape[0] != int(mask.sum()):
        raise RunError(f"{features.shape[0]} image features for {int(mask.sum())} image placeholders of the micro-batch")
    embeds = embeds.masked_scatter(mask.unsqueeze(-1).expand_as(embeds), features.to(embeds.dtype))
    inputs["inputs_embeds"] = embeds
    return inputs
