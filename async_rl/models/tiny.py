"""A tiny random-init Qwen2-style model with a character-level tokenizer, created offline.

Used by the quickstart and the tests: no hub download, a few hundred thousand parameters (the wider
benchmark preset: 13M), head_dim >= 32 (vLLM's CPU attention needs >= 32). Written to a temporary folder and renamed into place, so a
crashed creation never leaves a half-written model behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

from async_rl.errors import ConfigError
from async_rl.models import smollm2, tiny_llava, tiny_moe, tiny_qwen3_vl, tiny_vl, upcycle
from async_rl.models.moe import MoeRouting, read_routing
from async_rl.vision import is_vision_model
from async_rl.vision_family import model_type

_PRESET_VERSION = "v1"


class PresetShape(NamedTuple):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int


# 'tiny-qwen2': ~0.4M parameters, the quickstart and the tests. 'tiny-qwen2-wide': ~13M parameters,
# for throughput benchmarks where training must cost about as much as generation (on the tiny
# preset vLLM's per-step overhead dominates and training is nearly free).
SHAPES: dict[str, PresetShape] = {
    "tiny-qwen2": PresetShape(128, 256, 2, 4, 2),
    "tiny-qwen2-wide": PresetShape(512, 1536, 4, 8, 4),
}
# Mixture-of-experts presets (models/tiny_moe.py: their sizes by name) and vision-language ones
# (models/tiny_vl.py: Qwen2.5-VL; models/tiny_llava.py: LLaVA; models/tiny_qwen3_vl.py: Qwen3-VL), the same
# tokenizer (the VLMs' with their vision tokens added).
VLM_PRESETS = (*tiny_vl.PRESETS, *tiny_llava.PRESETS, *tiny_qwen3_vl.PRESETS)
PRESETS = (*SHAPES, *tiny_moe.PRESETS, *VLM_PRESETS)  # created offline from code
# every name model.path accepts besides a folder (config.MODEL_PRESETS)
ALL_PRESETS = (*SHAPES, *tiny_moe.PRESETS, smollm2.NAME, upcycle.NAME, *VLM_PRESETS)
# the vision-language presets' model_type (config.json's), known without building them
VISION_PRESETS = {**dict.fromkeys(tiny_vl.PRESETS, "qwen2_5_vl"), **dict.fromkeys(tiny_llava.PRESETS, "llava"),
                  **dict.fromkeys(tiny_qwen3_vl.PRESETS, "qwen3_vl")}

# Characters the built-in tasks use; every one is its own token.
CHARS = list("0123456789abcdefghijklmnopqrstuvwxyz+-*=:?,. ")
SPECIAL = ["<|endoftext|>", "<unk>", "<pad>"]


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>", pad_token="<pad>"
    )


def build_model(vocab_size: int, eos_id: int, pad_id: int, seed: int = 0, shape: PresetShape = SHAPES["tiny-qwen2"]):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).to(torch.float32)


def ensure_preset(name: str, cache_dir: str | os.PathLike) -> Path:
    """Return the folder of preset `name`, creating it (atomically) on first use."""
    if name not in PRESETS:
        raise ConfigError(f"model.path '{name}' is neither a built-in preset {PRESETS} nor a folder")
    root = Path(cache_dir).expanduser()
    target = root / f"{name}-{_PRESET_VERSION}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        if name in tiny_vl.PRESETS:
            tiny_vl.write(name, tmp, build_tokenizer())  # weights, tokenizer and processor
        elif name in tiny_llava.PRESETS:
            tiny_llava.write(name, tmp, build_tokenizer())
        elif name in tiny_qwen3_vl.PRESETS:
            tiny_qwen3_vl.write(name, tmp, build_tokenizer())
        else:
            tokenizer = build_tokenizer()
            ids = (len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
            model = tiny_moe.preset(name, *ids) if name in tiny_moe.PRESETS else build_model(*ids, shape=SHAPES[name])
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process created it first; theirs is complete (rename is atomic).
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def resolve_model_path(path: str, cache_dir: str) -> Path:
    """`model.path` -> a local HF model folder; a preset is created (tiny, tiny MoE) or fetched and
    converted (smollm2-135m, see smollm2.py; its upcycled MoE, upcycle.py) into `cache_dir` on first use."""
    if path in PRESETS:
        return ensure_preset(path, cache_dir)
    if path == smollm2.NAME:
        return smollm2.ensure(cache_dir)
    if path == upcycle.NAME:
        return upcycle.ensure(cache_dir)
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ConfigError(f"model.path '{path}' does not exist (not a folder, not a preset {ALL_PRESETS})")
    if not (p / "config.json").is_file():
        raise ConfigError(f"model.path '{path}' has no config.json: not a Hugging Face model folder")
    return p.resolve()


def model_routing(path: str, cache_dir: str) -> MoeRouting | None:
    """The routing of `model.path`'s model (None: dense) without building a preset: a folder's config.json
    (models/moe.py), an MoE preset's from the code that builds it. The launcher resolves it once, before
    anything starts, for the checks that depend on it (the MoE learner settings, the frame limit)."""
    if path in tiny_moe.PRESETS:
        return tiny_moe.PRESETS[path].routing()
    if path == upcycle.NAME:
        return upcycle.routing()
    if path in ALL_PRESETS:  # the dense presets
        return None
    return read_routing(resolve_model_path(path, cache_dir))


def model_vision_type(path: str, cache_dir: str) -> str:
    """The model_type of `model.path`'s vision-language model ('' for a text model), without building a
    preset: the launcher checks that async_rl trains its family (`vision_family`)."""
    if path in VISION_PRESETS:
        return VISION_PRESETS[path]
    if path in ALL_PRESETS:
        return ""
    folder = resolve_model_path(path, cache_dir)
    return (model_type(folder) or "unknown") if is_vision_model(folder) else ""
