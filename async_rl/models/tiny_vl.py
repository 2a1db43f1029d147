"""Tiny random-init vision-language models built offline from code: the VLM presets and the tests' models.

`tiny-qwen2.5-vl`: Qwen2.5-VL's architecture (a ViT with 2-D rotary positions, windowed and full
attention blocks, a 2x2 patch merger; a Qwen2 language model with 3-D multimodal rotary positions) at
the tiny preset's sizes: 2 vision blocks of width 64 (head_dim 32), a language model of hidden 128, 2
layers, head_dim 32 (vLLM's CPU attention needs >= 32), fp32, tied embeddings. The tokenizer is the
tiny preset's character tokenizer (models/tiny.py hands it in) with Qwen's vision tokens added, and the processor (image processor,
video processor, tokenizer) is saved beside the weights, so vLLM and the learner load the same one.

Images are processed at `PIXELS` pixels (56x56: 16 patches of 14x14, 4 image tokens after the merger)
unless the run's `vision.min_pixels`/`vision.max_pixels` say otherwise.
"""

from __future__ import annotations

from typing import NamedTuple

NAME = "tiny-qwen2.5-vl"
PIXELS = 56 * 56  # the preset processor's default budget: min_pixels = max_pixels
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# The prompt text that stands for one image: the processor expands the pad to the image's tokens.
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def chat_template(image_placeholder: str) -> str:
    """A tiny VLM processor's chat template: the messages' parts in order, no roles (the character
    tokenizer has no tokens for them), each image as `image_placeholder` (which the processor expands)."""
    return (
        "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}"
        "{% if c.type == 'image' %}" + image_placeholder + "{% else %}{{ c.text }}{% endif %}"
        "{% endfor %}{% endif %}{% endfor %}"
    )


CHAT_TEMPLATE = chat_template(IMAGE_PLACEHOLDER)


class TinyVl(NamedTuple):
    """The sizes of a tiny Qwen2.5-VL."""

    hidden_size: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 256
    vision_width: int = 64
    vision_depth: int = 2
    vision_heads: int = 2
    vision_intermediate: int = 128
    max_positions: int = 512


PRESETS: dict[str, TinyVl] = {NAME: TinyVl()}


def build_tokenizer(tokenizer):
    """`tokenizer` (the tiny preset's character tokenizer) with Qwen's vision tokens added (special: never split)."""
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    return tokenizer


def build_processor(tokenizer, pixels: int = PIXELS):
    from transformers import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    size = {"shortest_edge": pixels, "longest_edge": pixels}
    images = Qwen2VLImageProcessorPil(size=size, min_pixels=pixels, max_pixels=pixels)
    return Qwen2_5_VLProcessor(
        image_processor=images, tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor(), chat_template=CHAT_TEMPLATE
    )


def build_model(shape: TinyVl, tokenizer, seed: int = 0):
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in VISION_TOKENS}
    head_dim = shape.hidden_size // shape.heads
    half = head_dim // 2
    section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]  # Qwen's 16:24:24 split, scaled
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "max_position_embeddings": shape.max_positions,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
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
        "out_hidden_size": shape.hidden_size,
        "fullatt_block_indexes": [shape.vision_depth - 1],
        "window_size": 112,
    }
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)


def write(name: str, folder, base_tokenizer) -> None:
    """Build preset `name` into the (existing, empty) `folder`: weights, tokenizer (`base_tokenizer`, the
    tiny preset's, with the vision tokens), processor."""
    tokenizer = build_tokenizer(base_tokenizer)
    model = build_model(PRESETS[name], tokenizer)
    model.save_pretrained(folder, safe_serialization=True)
    build_processor(tokenizer).save_pretrained(folder)
