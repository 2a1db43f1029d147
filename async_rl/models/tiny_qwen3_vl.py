"""`tiny-qwen3-vl`: a tiny random-init Qwen3-VL built offline from code, the family with DeepStack.

Qwen3-VL's architecture (Qwen3VLForConditionalGeneration): a ViT with 16-pixel patches, a learned position
grid resampled to each image and 2-D rotary positions, a 2x2 patch merger; DeepStack mergers that take the
features of inner tower blocks (`deepstack_visual_indexes`) and add them to the first language-model
layers' outputs at the image tokens; a Qwen3 language model (q/k norms) with interleaved 3-D rotary
positions. Sizes: 3 vision blocks of width 64 (head_dim 32), DeepStack from blocks 0 and 1 (so both
language-model layers take a DeepStack feature), the language model of the tiny Qwen2.5-VL (hidden 128,
2 layers, head_dim 32: vLLM's CPU attention needs >= 32), fp32, tied embeddings. The tokenizer is the tiny
preset's character tokenizer with Qwen's vision tokens added (`tiny_vl.build_tokenizer`); the processor
(image processor, video processor, tokenizer) is saved beside the weights, so vLLM and the learner load
the same one.

Images are processed at `PIXELS` pixels (64x64: 16 patches of 16x16, 4 image tokens after the merger)
unless the run's `vision.min_pixels`/`vision.max_pixels` say otherwise.
"""

from __future__ import annotations

from typing import NamedTuple

from async_rl.models.tiny_vl import CHAT_TEMPLATE, VISION_TOKENS, TinyVl, build_tokenizer

NAME = "tiny-qwen3-vl"
PATCH = 16  # Qwen3-VL's patch size (Qwen2.5-VL's is 14)
MERGE = 2
PIXELS = (PATCH * MERGE * 2) ** 2  # the preset processor's default budget (64x64): min_pixels = max_pixels


class TinyQwen3Vl(NamedTuple):
    """The sizes of a tiny Qwen3-VL: its language model's are the tiny Qwen2.5-VL's (`language`)."""

    language: TinyVl = TinyVl()  # hidden_size, layers, heads, kv_heads, intermediate_size, max_positions
    vision_width: int = 64
    vision_depth: int = 3
    vision_heads: int = 2
    vision_intermediate: int = 128
    deepstack: tuple[int, ...] = (0, 1)  # the tower blocks whose features go to language-model layers 0, 1
    position_grid: int = 16  # the learned position grid's side (num_position_embeddings = its square)


PRESETS: dict[str, TinyQwen3Vl] = {NAME: TinyQwen3Vl()}


def build_processor(tokenizer, pixels: int = PIXELS):
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    size = {"shortest_edge": pixels, "longest_edge": pixels}
    # The PIL image processor (not the torchvision one): no torchvision op on the learner's path; Qwen3-VL's
    # published processors normalise to [-1, 1] (mean = std = 0.5)
    half = [0.5, 0.5, 0.5]
    images = Qwen2VLImageProcessorPil(size=size, patch_size=PATCH, merge_size=MERGE, image_mean=half, image_std=half)
    videos = Qwen3VLVideoProcessor(patch_size=PATCH, merge_size=MERGE, image_mean=half, image_std=half)
    return Qwen3VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=videos,
                            chat_template=CHAT_TEMPLATE)


def build_model(shape: TinyQwen3Vl, tokenizer, seed: int = 0):
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    lm = shape.language
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in VISION_TOKENS}
    head_dim = lm.hidden_size // lm.heads
    half = head_dim // 2
    # Qwen3-VL's interleaved 24:20:20 split of 64 frequencies, scaled to `half`: each of H and W takes every
    # third frequency from its offset, so 3 * its share may not pass `half`
    hw = half // 3
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": lm.hidden_size,
        "intermediate_size": lm.intermediate_size,
        "num_hidden_layers": lm.layers,
        "num_attention_heads": lm.heads,
        "num_key_value_heads": lm.kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": lm.max_positions,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [half - 2 * hw, hw, hw],
                            "mrope_interleaved": True},
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": True,
    }
    vision = {
        "depth": shape.vision_depth,
        "hidden_size": shape.vision_width,
        "intermediate_size": shape.vision_intermediate,
        "num_heads": shape.vision_heads,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "out_hidden_size": lm.hidden_size,
        "num_position_embeddings": shape.position_grid**2,
        "deepstack_visual_indexes": list(shape.deepstack),
    }
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return Qwen3VLForConditionalGeneration(config).to(torch.float32)


def write(name: str, folder, base_tokenizer) -> None:
    """Build preset `name` into the (existing, empty) `folder`: weights, tokenizer (`base_tokenizer`, the
    tiny preset's, with the vision tokens), processor."""
    tokenizer = build_tokenizer(base_tokenizer)
    model = build_model(PRESETS[name], tokenizer)
    model.save_pretrained(folder, safe_serialization=True)
    build_processor(tokenizer).save_pretrained(folder)
