"""`tiny-llava`: a tiny random-init LLaVA built offline from code, the family without a video processor.

LLaVA's architecture (LlavaForConditionalGeneration): a CLIP vision tower, a two-layer projector and a
Llama language model with plain 1-D rotary positions. Its processor resizes and crops every image to one
fixed size, so every image makes the same number of tokens, whatever its size on disk: here 56x56 in
patches of 14, 16 tokens an image (the CLS token dropped: `vision_feature_select_strategy` "default").
Sizes: 2 CLIP layers of width 64 (head_dim 32), a language model of hidden 128, 2 layers, head_dim 32
(vLLM's CPU attention needs >= 32), fp32, tied embeddings. The tokenizer is the tiny preset's character
tokenizer (models/tiny.py hands it in) with LLaVA's `<image>` token added; the processor is saved beside
the weights, so vLLM and the learner load the same one.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from async_rl.models.tiny_vl import TinyVl, chat_template

NAME = "tiny-llava"
IMAGE_TOKEN = "<image>"  # LLaVA's placeholder, also the prompt text's image marker (images.IMAGE_MARKER)
CHAT_TEMPLATE = chat_template(IMAGE_TOKEN)


class TinyLlava(NamedTuple):
    """The sizes of a tiny LLaVA: its language model's are the tiny Qwen2.5-VL's (`language`)."""

    language: TinyVl = TinyVl()  # hidden_size, layers, heads, kv_heads, intermediate_size, max_positions
    image_size: int = 56  # every image is resized and cropped to this square
    patch_size: int = 14
    vision_width: int = 64
    vision_layers: int = 2  # LLaVA reads the second-to-last layer's features: at least 2
    vision_heads: int = 2
    vision_intermediate: int = 128

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2


PRESETS: dict[str, TinyLlava] = {NAME: TinyLlava()}


def build_tokenizer(tokenizer):
    """`tokenizer` (the tiny preset's character tokenizer) with LLaVA's image token added (special: never split)."""
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    return tokenizer


def build_processor(tokenizer, shape: TinyLlava):
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    # The PIL image processor (not the torchvision one): no torchvision op on the learner's path.
    images = CLIPImageProcessorPil(
        size={"shortest_edge": shape.image_size}, crop_size={"height": shape.image_size, "width": shape.image_size}
    )
    return LlavaProcessor(
        image_processor=images, tokenizer=tokenizer, patch_size=shape.patch_size,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,  # CLIP's CLS token, dropped
        chat_template=CHAT_TEMPLATE, image_token=IMAGE_TOKEN,
    )


def build_model(shape: TinyLlava, tokenizer, seed: int = 0):
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    lm = shape.language
    text = {
        "model_type": "llama",
        "vocab_size": len(tokenizer),
        "hidden_size": lm.hidden_size,
        "intermediate_size": lm.intermediate_size,
        "num_hidden_layers": lm.layers,
        "num_attention_heads": lm.heads,
        "num_key_value_heads": lm.kv_heads,
        "max_position_embeddings": lm.max_positions,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": True,
    }
    vision = {
        "model_type": "clip_vision_model",
        "hidden_size": shape.vision_width,
        "intermediate_size": shape.vision_intermediate,
        "num_hidden_layers": shape.vision_layers,
        "num_attention_heads": shape.vision_heads,
        "image_size": shape.image_size,
        "patch_size": shape.patch_size,
        "projection_dim": shape.vision_width,
    }
    config = LlavaConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(config).to(torch.float32)


def write(name: str, folder, base_tokenizer) -> None:
    """Build preset `name` into the (existing, empty) `folder`: weights, tokenizer (`base_tokenizer`, the
    tiny preset's, with the image token), processor."""
    shape = PRESETS[name]
    tokenizer = build_tokenizer(base_tokenizer)
    model = build_model(shape, tokenizer)
    model.save_pretrained(folder, safe_serialization=True)
    published_layout(Path(folder) / "model.safetensors")
    build_processor(tokenizer, shape).save_pretrained(folder)


def published_layout(weights: Path) -> None:
    """Rename the CLIP tower's weights in `weights` to the layout of published LLaVA checkpoints
    (`vision_tower.vision_model.*`). transformers 5 saves its flattened CLIPVisionModel without the
    `vision_model.` level (and loads either); vLLM's loader knows only the published one."""
    from safetensors.torch import load_file, save_file

    tower = "vision_tower."
    state = load_file(weights)
    renamed = {(tower + "vision_model." + k[len(tower):] if k.startswith(tower) else k): v for k, v in state.items()}
    save_file(renamed, weights, metadata={"format": "pt"})
