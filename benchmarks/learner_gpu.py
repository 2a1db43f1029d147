"""`bench_learner.py --device cuda`: one learner step on a GPU, each of its switches on and off, beside
a plain Hugging Face step written the way TRL computes GRPO.

    python benchmarks/bench_learner.py --device cuda --out gpu/<DATE>-learner [--dry-run]
        [--shapes qwen2.5-0.5b,qwen2.5-1.5b] [--batch 64x8] [--variants ...] [--repeats 1]
        [--variant-timeout 110] [--budget-s 230]

writes benchmarks/results/<out>.json and .md and exits 0 when it ran; without CUDA it prints one last
line `SKIP: <reason>` and exits 3. `--dry-run`: a tiny model and batch, every default variant, seconds.

Models: random-init Qwen2.5-0.5B and -1.5B shapes (no download), saved once per run in bf16 (the learner
loads them into fp32 master weights). MoE: `--shapes qwen3-30b-a3b-4l`, Qwen3-30B-A3B's widths,
128 experts top-8, 4 of its 48 layers (2.7B parameters, ~0.9B active), every sample with random routes
that `combined` replays (`combined_live`: the live router; `combined_eager_experts`: HF's loop over the
experts instead of grouped GEMMs); its `trl` row is plain HF with transformers' default experts (grouped_mm
in 5.19) and the live router; MFU counts the active parameters. VLM: `--shapes qwen2.5-vl-3b`, Qwen2.5-VL-3B's
language model (36 layers of 2048) and vision tower (32 blocks of 1280, patch 14, 2x2 merger) at random init, the
tokenizer the tiny character one with Qwen's vision tokens and the processor the tiny preset's (models/tiny_vl.py:
the 3B's patch and merge sizes) under the GPU recipe's pixel bounds (configs/gpu/1gpu_qwen2.5_vl_3b_geo3k.yaml:
256 to 1,280 image tokens); every prompt holds one image of random size (160-1000 pixels a side), its placeholder
expanded by that processor exactly as the learner checks it, then 90-200 characters of text. As the recipe: the
vision tower frozen but for its merger, activation checkpointing. `combined` is our learner; `trl` is plain HF
(padded rows, left-padded prompts, pixel_values, image_grid_thw and mm_token_type_ids to the HF model as its
processor returns them, logits_to_keep, log-softmax + gather, bf16 autocast, the same frozen tower and
gradient checkpointing, fused AdamW). Target: ours (combined) >= 2.0x the plain HF step. MFU counts the language
model's parameters over the tokens (the vision tower's patches not counted: an underestimate). `--dry-run
--shapes tiny-vl`: the tiny preset's widths, 28-112 pixel images. Batch: the 1-GPU recipe's shape, `--batch PROMPTSxSAMPLES`
(default 64x8), prompts 90-200 tokens, completions long-tailed (log-normal, median 220, capped at 512:
mean ~264), random tokens. Each (shape, variant) runs in its own process with a timeout, rounds
interleaved (A B C A B C): one warm-up step on two groups, then `--steps` timed steps of the whole
batch; the best counts. Before any step each child scores `--score-samples` samples (no grad, the
initial weights) and the parent compares the log-probs with the `fp32` child's (fp32 weights and
compute, eager kernels, SDPA): each switch's log-prob difference. MFU = 6 x parameters x tokens (each
sample's prompt counted) / step seconds / the bf16 matmul rate measured in this run (8192^3). Peak
memory: torch.cuda.max_memory_allocated over the timed step.

Variants (learner.* overrides; `today` is the learner's former default: autocast, eager kernels):
  today          mixed_precision=bf16 (autocast), kernels=none, attention=sdpa where the field exists
  bf16_params    today + the bf16 working copy (learner/model/precision.py)
  liger          today + kernels=liger (needs the liger-kernel package; the row says so if it is absent)
  compile        today + kernels=compile (regional torch.compile of the decoder layers)
  varlen, flex   today + learner.attention=varlen / flex (skipped with a note where the field is absent)
  auto_budget    today + micro_batch_tokens=auto
  combined       every switch at its default (mixed_precision, kernels, attention, head_kernel: auto), at
                 --tokens; the head's kernel is the one its start-up probe measured fastest (the row's
                 notes give the probe's line)
  combined_auto  combined with micro_batch_tokens=auto
  combined_flex  combined with attention=flex (compiled block masks, dynamic shapes) for every block
  combined_compile combined with kernels=compile (regional torch.compile) in place of Liger
  combined_eager_head combined with head_kernel=eager: the compiled head's gain (learner/model/head_fused.py)
  combined_compiled_head combined with head_kernel=compiled (inductor's kernels, the vocabulary static)
  combined_recompute combined with logprob_keep_logits=false: the head recomputes each chunk's logits
                 in the backward (kept, the CUDA default, saves one GEMM a chunk for their memory)
  combined_triton_head combined with head_kernel=triton: the forward statistics in the hand-written
                 Triton kernel (learner/model/head_triton.py), the backward compiled.
  combined_unshared combined with share_prompt=false: every sample computes its own prompt, as megatron
                 did before its varlen row took shared prompts (`megatron_sdpa` still does)
  megatron       learner.backend=megatron without Transformer Engine (transformer_engine=off), its
                 attention at the default (learner.megatron.attention auto = varlen flash attention on
                 CUDA in bf16), the model in bf16 (megatron's fp32 main weights in the optimizer), at
                 --tokens: the target is this row's step within 1.5x of `combined`'s. Not in the
                 defaults.
  megatron_sdpa  the same with torch's SDPA and the block-diagonal mask (learner.megatron.attention=sdpa,
                 auto before 2026-11-28)
  megatron_local the same with megatron's local DotProductAttention (learner.megatron.attention=local):
                 the attention's gain, where it fits in memory. Not in the defaults.
  trl            the plain HF step: padded rows, left-padded prompts, logits_to_keep, log-softmax +
                 gather per row, bf16 autocast, fused AdamW (as TRL's GRPO trainer computes its loss)
  fp32           scoring only: the log-prob reference
The chunked head's savings (weight cast hoisted, one exponent pass, weight gradient in the GEMM, no
entropy in scoring passes) are in every row of ours: they have no switch. Its per-chunk kernel
(learner.head_kernel) is the probe's choice in the combined rows and the megatron ones (auto: the fastest
of eager, compiled and triton measured at start-up, learner/model/head_probe.py; megatron at TP = PP = 1), eager
in `today` and the single-switch rows; the three `combined_*_head` rows fix it, so the probe's choice can be
checked against whole steps.

The children run on the CPU too (`learner_child(a, "cpu")`, `trl_child(a, "cpu")`: tests/unit/test_bench_learner_vlm.py
runs the tiny VLM's rows so).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SKIP_RC = 3

SHAPES = {
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    # the long-context recipe's model (configs/gpu/8gpu_long_context_sp4.yaml); `--longest` only (longest_sequence.py)
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    "tiny": dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # Qwen3-30B-A3B's widths, expert count and top-k (48 layers there; 4 here: 2.7B parameters, fp32 masters +
    # AdamW ~43 GiB, so one GPU holds it with the batch's activations). Routes: random per token (replayed).
    "qwen3-30b-a3b-4l": dict(family="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                             moe_intermediate_size=768, num_hidden_layers=4, num_attention_heads=32,
                             num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                             norm_topk_prob=True, tie_word_embeddings=False),
    "tiny-moe": dict(family="qwen3_moe", vocab_size=4096, hidden_size=128, intermediate_size=256,
                     moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=True),
    # Qwen2.5-VL-3B-Instruct's widths (its config.json): the language model at the top, the vision tower in `vision`;
    # `pixels`: the GPU recipe's bounds (min, max) per image; `sides`: the images' random heights and widths
    "qwen2.5-vl-3b": dict(family="qwen2_5_vl", vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                          num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True,
                          vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                      out_hidden_size=2048, fullatt_block_indexes=[7, 15, 23, 31], window_size=112,
                                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
                          pixels=(256 * 28 * 28, 1280 * 28 * 28), sides=(160, 1000)),
    "tiny-vl": dict(family="qwen2_5_vl", vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                    vision=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                                fullatt_block_indexes=[1], window_size=112, patch_size=14, spatial_merge_size=2,
                                temporal_patch_size=2),
                    pixels=(28 * 28, 112 * 112), sides=(28, 112)),
}
VL_LEARNER = {"freeze_vision": True, "activation_checkpointing": True}  # the GPU recipe's, on every VLM row
TODAY = {"mixed_precision": "bf16", "kernels": "none", "attention": "sdpa", "head_kernel": "eager",
         "logprob_keep_logits": False}
VARIANTS: dict[str, dict] = {
    "today": TODAY,
    "bf16_params": {**TODAY, "mixed_precision": "bf16_params"},
    "liger": {**TODAY, "kernels": "liger"},
    "compile": {**TODAY, "kernels": "compile"},
    "varlen": {**TODAY, "attention": "varlen"},
    "flex": {**TODAY, "attention": "flex"},
    "auto_budget": {**TODAY, "micro_batch_tokens": "auto"},
    "combined": {"mixed_precision": "auto", "kernels": "auto", "attention": "auto"},
    "combined_auto": {"mixed_precision": "auto", "kernels": "auto", "attention": "auto", "micro_batch_tokens": "auto"},
    "combined_flex": {"mixed_precision": "auto", "kernels": "auto", "attention": "flex"},
    "combined_compile": {"mixed_precision": "auto", "kernels": "compile", "attention": "auto"},
    "combined_eager_head": {"mixed_precision": "auto", "kernels": "auto", "attention": "auto", "head_kernel": "eager"},
    "combined_compiled_head": {"mixed_precision": "auto", "kernels": "auto", "attention": "auto", "head_kernel": "compiled"},
    "combined_triton_head": {"mixed_precision": "auto", "kernels": "auto", "attention": "auto", "head_kernel": "triton"},
    "combined_recompute": {"mixed_precision": "auto", "kernels": "auto", "attention": "auto", "logprob_keep_logits": False},
    "combined_unshared": {"mixed_precision": "auto", "kernels": "auto", "attention": "auto", "share_prompt": False},
    "megatron": {"backend": "megatron", "megatron": {"transformer_engine": "off", "attention": "auto"}},
    "megatron_sdpa": {"backend": "megatron", "megatron": {"transformer_engine": "off", "attention": "sdpa"}},
    "megatron_local": {"backend": "megatron", "megatron": {"transformer_engine": "off", "attention": "local"}},
    "trl": {},
    "fp32": {"mixed_precision": "none", "kernels": "none", "attention": "sdpa", "head_kernel": "eager"},
    # MoE shapes: `combined` replays the batch's routes (learner.routing_replay auto) with the
    # experts as grouped GEMMs (learner.moe_experts auto); these switch one thing off
    "combined_live": {"mixed_precision": "auto", "kernels": "auto", "attention": "auto", "routing_replay": "off"},
    "combined_eager_experts": {"mixed_precision": "auto", "kernels": "auto", "attention": "auto", "moe_experts": "eager"},
}
# What `make gpu-check` runs (about 4 minutes on an H200 before the Triton row): the targets' rows on both shapes and
# the two head kernels against the eager head.
DEFAULT_VARIANTS = {"qwen2.5-0.5b": "combined,combined_eager_head,combined_triton_head,trl,fp32", "qwen2.5-1.5b": "combined,trl,fp32",
                    "qwen3-30b-a3b-4l": "combined,combined_live,combined_eager_experts,trl,fp32",
                    "tiny-moe": "combined,combined_live,combined_eager_experts,trl,fp32",
                    "qwen2.5-vl-3b": "combined,trl,fp32", "tiny-vl": "combined,trl,fp32"}
# The targets (one H100, same batch and token budget, same run).
MFU_TARGET = {"qwen2.5-0.5b": 0.40, "qwen2.5-1.5b": 0.45}
SPEEDUP_TARGET = 2.0
MEGATRON_TARGET = 1.5  # megatron's step (no TE) over the torch backend's, same model, batch and budget


# ---- the batch and the model ---------------------------------------------------------------------------


def moe_of(shape: str) -> tuple[int, int, int] | None:
    """(MoE layers, experts, top-k) of an MoE shape, None for a dense one."""
    s = SHAPES[shape]
    return (s["num_hidden_layers"], s["num_experts"], s["num_experts_per_tok"]) if s.get("family") == "qwen3_moe" else None


def random_routes(rng, tokens: int, moe: tuple[int, int, int]):
    """Routes for one sample of `tokens` tokens: top-k distinct random experts per token and layer, in the
    contract's dtype and rows (protocol.py: the last token has none)."""
    import numpy as np

    from async_rl.protocol import route_dtype

    layers, experts, top_k = moe
    keys = rng.random((tokens - 1, layers, experts), dtype=np.float32)
    return np.argpartition(keys, top_k, axis=-1)[..., :top_k].astype(route_dtype(experts))


def make_groups(vocab: int, prompts: int, group_size: int, max_completion: int, seed: int = 0,
                moe: tuple[int, int, int] | None = None) -> list:
    import numpy as np

    from async_rl.protocol import TrajectoryGroup

    rng = np.random.default_rng(seed)
    out = []
    for pid in range(prompts):
        prompt = rng.integers(10, vocab, size=int(rng.integers(90, 201))).astype(np.int32)
        lengths = np.clip(rng.lognormal(np.log(220), 0.6, size=group_size), 16, max_completion).astype(int)
        comps = [rng.integers(10, vocab, size=int(n)).astype(np.int32) for n in lengths]
        out.append(TrajectoryGroup(
            prompt_id=pid, engine_id=0, prompt_tokens=prompt, completions=comps,
            logprobs=[(-2.0 + 0.1 * rng.standard_normal(len(c))).astype(np.float32) for c in comps],
            rewards=[float(r) for r in rng.permutation([i % 2 for i in range(group_size)])],
            version_first=[0] * group_size, version_last=[0] * group_size, reward_status=[0] * group_size,
            routes=[random_routes(rng, len(prompt) + len(c), moe) for c in comps] if moe else None,
        ))
    return out


def batch_counts(groups: list) -> dict:
    completion = sum(len(c) for g in groups for c in g.completions)
    tokens = sum(len(g.prompt_tokens) * len(g.completions) for g in groups) + completion
    return {"samples": sum(len(g.completions) for g in groups), "tokens": tokens, "completion_tokens": completion}


def score_groups(groups: list, samples: int) -> list:
    """The first groups holding `samples` samples: what every child scores for the log-prob comparison."""
    out, n = [], 0
    for g in groups:
        if n >= samples:
            break
        out.append(g)
        n += len(g.completions)
    return out


def make_model(dest: Path, shape: str, max_positions: int = 4096) -> int:
    """A random-init model of `shape` saved in bf16 at `dest` (once); returns its parameter count (an
    MoE's active parameters: what MFU counts). `max_positions`: its config's max_position_embeddings."""
    if is_vl(shape):
        return make_vl_model(dest, shape, max_positions)
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3MoeConfig

    from async_rl.models.tiny import build_tokenizer

    fields = {k: v for k, v in SHAPES[shape].items() if k != "family"}
    config_class = Qwen3MoeConfig if SHAPES[shape].get("family") == "qwen3_moe" else Qwen2Config
    cfg = config_class(**fields, max_position_embeddings=max_positions, rope_theta=1e6, rms_norm_eps=1e-6,
                       bos_token_id=0, eos_token_id=0, pad_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    if moe := moe_of(shape):  # MoE: the parameters a token runs through (its top-k experts' share)
        _, experts, top_k = moe
        routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        params -= routed - routed * top_k // experts
    if not (dest / "config.json").exists():
        model.save_pretrained(dest, safe_serialization=True)
        build_tokenizer().save_pretrained(dest)
    del model
    return params


def is_vl(shape: str) -> bool:
    return SHAPES[shape].get("family") == "qwen2_5_vl"


def vision_settings(shape: str):
    """The run's `vision` section for a VLM shape: its pixel bounds, one image a prompt (the recipe's)."""
    from async_rl.config import VisionConfig

    lo, hi = SHAPES[shape]["pixels"]
    return VisionConfig(min_pixels=lo, max_pixels=hi, max_images_per_prompt=1)


def vl_parts(shape: str, max_positions: int = 4096):
    """(config, processor) of VLM `shape`: its Qwen2_5_VLConfig with the tiny preset's tokenizer's vision token
    ids, and the tiny preset's processor (models/tiny_vl.py), checked to cut the tower's patches."""
    from transformers import Qwen2_5_VLConfig

    from async_rl.models import tiny, tiny_vl

    s = SHAPES[shape]
    tokenizer = tiny_vl.build_tokenizer(tiny.build_tokenizer())
    processor = tiny_vl.build_processor(tokenizer)  # its pixel bounds: the run's (vision_settings) override them
    images, vision = processor.image_processor, s["vision"]
    got = (images.patch_size, images.merge_size, images.temporal_patch_size)
    want = (vision["patch_size"], vision["spatial_merge_size"], vision["temporal_patch_size"])
    if got != want:
        raise RuntimeError(f"{shape}: the tiny preset's processor cuts patches {got}, the tower expects {want}")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in tiny_vl.VISION_TOKENS}
    half = s["hidden_size"] // s["num_attention_heads"] // 2
    section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]  # Qwen's 16:24:24 at head_dim 128
    text = {k: v for k, v in s.items() if k not in ("family", "vision", "pixels", "sides")}
    text.update(max_position_embeddings=max_positions, rms_norm_eps=1e-6, eos_token_id=tokenizer.eos_token_id,
                bos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": section})
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=s["tie_word_embeddings"],
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return cfg, processor


def language_params(model) -> int:
    """The parameters outside the vision tower (what MFU counts for a VLM)."""
    return sum(p.numel() for n, p in model.named_parameters() if ".visual." not in f".{n}")


def make_vl_model(dest: Path, shape: str, max_positions: int) -> int:
    """A random-init Qwen2.5-VL of `shape` (vl_parts) saved in bf16 with its processor at `dest` (once);
    returns the language model's parameter count."""
    import torch
    from transformers import AutoModelForImageTextToText

    cfg, processor = vl_parts(shape, max_positions)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.bfloat16)
    params = language_params(model)
    if not (dest / "config.json").exists():
        model.save_pretrained(dest, safe_serialization=True)
        processor.save_pretrained(dest)
    del model
    return params


def image_png(rng, height: int, width: int) -> bytes:
    """A random 8x8 colour grid scaled to height x width (PNG: compresses like a diagram, decodes fast)."""
    import numpy as np
    from PIL import Image

    from async_rl.images import encode_png

    grid = Image.fromarray(rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8))
    return encode_png(grid.resize((width, height), Image.Resampling.NEAREST))


def make_vl_groups(model_dir: Path, shape: str, prompts: int, group_size: int, max_completion: int,
                   seed: int = 0) -> list:
    """`make_groups` for a VLM: every prompt one image of random size, rendered by the model's processor at the
    shape's pixel bounds (the learner's own `VisionModel`: the placeholder expanded to the image's tokens as
    the learner checks), then 90-200 random characters; completions as make_groups', never a vision token."""
    import numpy as np

    from async_rl.models.tiny_vl import VISION_TOKENS
    from async_rl.protocol import TrajectoryGroup
    from async_rl.vision import VisionModel

    vision = VisionModel(model_dir, vision_settings(shape))
    special = np.array(vision.processor.tokenizer.convert_tokens_to_ids(VISION_TOKENS))
    rng = np.random.default_rng(seed)
    lo, hi = SHAPES[shape]["sides"]
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz0123456789 +-=?"))
    out = []
    for pid in range(prompts):
        image = image_png(rng, int(rng.integers(lo, hi + 1)), int(rng.integers(lo, hi + 1)))
        question = "".join(rng.choice(letters, size=int(rng.integers(90, 201))))
        prompt = np.array(vision.render([("user", "<image>" + question)], [image], 0), dtype=np.int32)
        lengths = np.clip(rng.lognormal(np.log(220), 0.6, size=group_size), 16, max_completion).astype(int)
        comps = [rng.integers(10, SHAPES[shape]["vocab_size"], size=int(n)).astype(np.int32) for n in lengths]
        comps = [np.where(np.isin(c, special), 10, c).astype(np.int32) for c in comps]  # a sampled placeholder is text
        out.append(TrajectoryGroup(
            prompt_id=pid, engine_id=0, prompt_tokens=prompt, completions=comps,
            logprobs=[(-2.0 + 0.1 * rng.standard_normal(len(c))).astype(np.float32) for c in comps],
            rewards=[float(r) for r in rng.permutation([i % 2 for i in range(group_size)])],
            version_first=[0] * group_size, version_last=[0] * group_size, reward_status=[0] * group_size,
            images=[image],
        ))
    return out


def groups_of(shape: str, model_dir: Path, prompts: int, group_size: int, max_completion: int) -> list:
    """The batch of `shape` (the same in every child: seeded)."""
    if is_vl(shape):
        return make_vl_groups(model_dir, shape, prompts, group_size, max_completion)
    return make_groups(SHAPES[shape]["vocab_size"], prompts, group_size, max_completion, moe=moe_of(shape))


def matmul_rate() -> float:
    """bf16 FLOP/s of an 8192^3 matmul on this GPU (the MFU denominator)."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    return 20 * 2 * 8192**3 / (time.perf_counter() - t)


# ---- a child: one (shape, variant) -----------------------------------------------------------------------


def learner_overrides(variant: str, tokens: int) -> tuple[dict, list[str]]:
    """The variant's LearnerConfig fields that this tree has, and notes on those it lacks."""
    from async_rl.config import LearnerConfig

    fields = {"micro_batch_tokens": tokens, **VARIANTS[variant]}
    known = set(LearnerConfig.__struct_fields__)
    notes = [f"learner.{k} is not in this tree's LearnerConfig: left out" for k in fields if k not in known]
    return {k: v for k, v in fields.items() if k in known}, notes


def learner_child(a: argparse.Namespace, device: str) -> dict:
    import msgspec
    import numpy as np
    import torch

    from async_rl.cluster.net import free_port
    from async_rl.config import (
        AlgorithmConfig,
        GeneratorConfig,
        LearnerConfig,
        ModelConfig,
        TrainConfig,
        WeightSyncConfig,
    )
    from async_rl.config.spec import LearnerSpec
    from async_rl.learner.driver import LearnerDriver

    groups = groups_of(a.shape, Path(a.model_dir), a.prompts, a.group_size, a.max_completion)
    fields, notes = learner_overrides(a.variant, a.tokens)
    if is_vl(a.shape):
        fields.update(VL_LEARNER)
    if a.variant in ("varlen", "flex") and "attention" not in fields:
        return {"skipped": notes[0]}
    dtype = "float32"
    if fields.get("backend") == "megatron":
        from async_rl.config import MegatronConfig

        m = fields["megatron"]
        if "attention" not in MegatronConfig.__struct_fields__:
            notes.append("learner.megatron.attention is not in this tree: megatron's local attention")
            m = {k: v for k, v in m.items() if k != "attention"}
        fields = {**fields, "megatron": MegatronConfig(**m)}
        # megatron computes in the model's dtype (fp32 main weights in its optimizer); on CPU fp32 only
        dtype = "bfloat16" if device == "cuda" else "float32"
    spec = LearnerSpec(
        model=ModelConfig(path=a.model_dir, dtype=dtype),
        learner=LearnerConfig(device=device, lr=1e-6, **fields),
        algorithm=AlgorithmConfig(), generators=GeneratorConfig(max_tokens=a.max_completion),
        train=TrainConfig(total_steps=10),
        weight_sync=WeightSyncConfig(backend="gloo", bucket_mb=1, host="127.0.0.1", timeout_s=10.0),
        run_id="bench_learner_gpu", model_dir=a.model_dir, reference_model_dir=a.model_dir,
        buffer_address="tcp://127.0.0.1:1", batch_timeout_s=1.0,
        **({"vision": vision_settings(a.shape)} if is_vl(a.shape) else {}),
    )
    rank = LearnerDriver(spec, 0, 1, f"127.0.0.1:{free_port()}", [])
    rank.setup()
    backend = rank.backend
    probe = getattr(backend, "head_probe", None)
    if probe is not None:
        notes.append(f"{a.variant}: {probe.line()}")
    ran = {"kernels": getattr(backend, "kernels", "none"), "fused_head": getattr(backend, "fused_head", False),
           "keeps_logits": backend.keeps_logits,
           "micro_batch_tokens": rank.micro_batch_tokens,
           "working_copy": getattr(backend, "working", None) is not None,
           "megatron_attention": backend.attention if fields.get("backend") == "megatron" else None,
           "routing_replay": backend.replays_routes, "experts": getattr(backend, "experts_kernel", None),
           "learner": msgspec.to_builtins(spec.learner)}
    logp = np.concatenate(rank.compute_logprobs(score_groups(groups, a.score_samples), 1.0))
    np.save(a.score_file, logp)
    if a.variant == "fp32":
        return {**ran, "notes": notes}
    rank.train_on_shard(0, groups[:2])  # warm-up: allocator, compile, optimizer state
    steps = []
    for k in range(a.steps):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        m = rank.train_on_shard(k + 1, groups)
        if device == "cuda":
            torch.cuda.synchronize()
        steps.append(time.perf_counter() - t)
        if m.loss != m.loss:
            raise RuntimeError("NaN loss")
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    if a.profile_file:
        profile_step(a.profile_file, lambda: rank.train_on_shard(a.steps + 1, groups))
    rank.shutdown()
    return {**ran, "notes": notes, "steps_s": steps, "peak_gib": peak, "micro_batches": m.micro_batches,
            "loss": float(m.loss)}


def trl_rows(groups: list, processor=None) -> list[tuple]:
    """(prompt, completion, old log-probs, advantage, images) per sample; images: the HF processor's
    pixel_values and image_grid_thw of the group's images (`processor`: a VLM's), else None."""
    import numpy as np

    rows = []
    for g in groups:
        r = np.asarray(g.rewards, np.float32)
        adv = (r - r.mean()) / (r.std() + 1e-4)
        images = trl_images(processor, g.images) if processor is not None and g.images else None
        for c, lp, a in zip(g.completions, g.logprobs, adv, strict=True):
            rows.append((g.prompt_tokens, c, lp, float(a), images))
    return rows


def trl_images(processor, images: list[bytes]) -> dict:
    """What HF's processor gives the model for a prompt's images (as TRL passes them on)."""
    import io

    from PIL import Image

    pils = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    out = processor.image_processor(images=pils, return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def trl_micro_batches(rows: list[tuple], tokens: int) -> list[list[tuple]]:
    """Rows sorted by length, cut so that rows x the widest row stay within `tokens` (padded)."""
    rows = sorted(rows, key=lambda r: len(r[0]) + len(r[1]))
    out, cur = [], []
    for r in rows:
        width = max(len(x[0]) + len(x[1]) for x in [*cur, r])
        if cur and width * (len(cur) + 1) > tokens:
            out.append(cur)
            cur = []
        cur.append(r)
    return [*out, cur] if cur else out


def trl_logp(model, mb: list[tuple], device: str):
    """TRL's per-token log-probs of a padded micro-batch (left-padded prompts, right-padded completions,
    logits_to_keep, log-softmax + gather per row in fp32) and its tensors."""
    import torch

    p_w, c_w = max(len(r[0]) for r in mb), max(len(r[1]) for r in mb)
    ids = torch.zeros(len(mb), p_w + c_w, dtype=torch.long)
    att = torch.zeros_like(ids)
    comp = torch.zeros(len(mb), c_w, dtype=torch.long)
    cmask, old, adv = torch.zeros(len(mb), c_w), torch.zeros(len(mb), c_w), torch.zeros(len(mb), 1)
    for i, (p, c, lp, a, _) in enumerate(mb):
        ids[i, p_w - len(p) : p_w] = torch.as_tensor(p)
        ids[i, p_w : p_w + len(c)] = torch.as_tensor(c)
        att[i, p_w - len(p) : p_w + len(c)] = 1
        comp[i, : len(c)] = torch.as_tensor(c)
        cmask[i, : len(c)] = 1
        old[i, : len(c)] = torch.as_tensor(lp)
        adv[i] = a
    ids, att, comp, cmask, old, adv = (t.to(device) for t in (ids, att, comp, cmask, old, adv))
    images = [r[4] for r in mb if r[4] is not None]
    kw = {}
    if images:  # the rows' images in row order; the model finds their placeholders in input_ids
        image_id = model.config.image_token_id
        kw = {"pixel_values": torch.cat([x["pixel_values"] for x in images]).to(device),
              "image_grid_thw": torch.cat([x["image_grid_thw"] for x in images]).to(device),
              "mm_token_type_ids": (ids == image_id).int()}
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        logits = model(input_ids=ids, attention_mask=att, logits_to_keep=c_w + 1, **kw).logits[:, :-1]
    logp = torch.stack([torch.gather(torch.log_softmax(row.float(), -1), -1, t[:, None])[:, 0]
                        for row, t in zip(logits, comp, strict=True)])
    return logp, cmask, old, adv


def trl_step(model, opt, rows: list[tuple], tokens: int, device: str) -> float:
    """One step on `rows` (trl_rows); returns the loss (summed over micro-batches: the batch's)."""
    import torch

    n_tok = sum(len(r[1]) for r in rows)
    total = 0.0
    for mb in trl_micro_batches(rows, tokens):
        logp, cmask, old, adv = trl_logp(model, mb, device)
        ratio = torch.exp(logp - old)
        per_token = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
        loss = (per_token * cmask).sum() / n_tok
        loss.backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def trl_model(a: argparse.Namespace):
    """The plain HF model (fp32 weights, SDPA) and, for a VLM, HF's processor at the shape's pixel bounds,
    the tower frozen but for its merger and gradient checkpointing on (as our rows: the GPU recipe's)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

    if not is_vl(a.shape):
        return AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32, attn_implementation="sdpa"), None
    processor = AutoProcessor.from_pretrained(a.model_dir, **vision_settings(a.shape).processor_kwargs())
    model = AutoModelForImageTextToText.from_pretrained(a.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    for name, p in model.named_parameters():
        p.requires_grad_(".visual." not in f".{name}" or ".merger." in name)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, processor


def trl_child(a: argparse.Namespace, device: str) -> dict:
    import numpy as np
    import torch

    groups = groups_of(a.shape, Path(a.model_dir), a.prompts, a.group_size, a.max_completion)
    model, processor = trl_model(a)
    model.to(device).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6, fused=device == "cuda")
    rows, warm = trl_rows(groups, processor), trl_rows(groups[:2], processor)  # images processed before the clock
    with torch.no_grad():  # the scored samples, in the batch's order (one micro-batch per sample)
        logp = [trl_logp(model, [r], device)[0][0, : len(r[1])].float().cpu().numpy()
                for r in trl_rows(score_groups(groups, a.score_samples), processor)]
    np.save(a.score_file, np.concatenate(logp))
    trl_step(model, opt, warm, a.tokens, device)
    steps = []
    for _ in range(a.steps):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        loss = trl_step(model, opt, rows, a.tokens, device)
        if device == "cuda":
            torch.cuda.synchronize()
        steps.append(time.perf_counter() - t)
        if loss != loss:
            raise RuntimeError("NaN loss")
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    if a.profile_file:
        profile_step(a.profile_file, lambda: trl_step(model, opt, rows, a.tokens, device))
    return {"steps_s": steps, "peak_gib": peak, "notes": [], "loss": loss}


def run_child(a: argparse.Namespace) -> None:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = trl_child(a, device) if a.variant == "trl" else learner_child(a, device)
    print("RESULT " + json.dumps(out), flush=True)


# ---- the parent ------------------------------------------------------------------------------------------


def child_command(a: argparse.Namespace, shape: str, variant: str, model_dir: Path, score: Path) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve().parent / "bench_learner.py"), "--device", "cuda", "--child",
            "--shape", shape, "--variant", variant, "--model-dir", str(model_dir), "--score-file", str(score),
            "--prompts", str(a.prompts), "--group-size", str(a.group_size), "--max-completion", str(a.max_completion),
            "--tokens", str(a.tokens), "--steps", str(a.steps), "--score-samples", str(a.score_samples),
            *(["--force-cpu"] if a.force_cpu else []),
            *(["--profile-file", str(RESULTS / f"{a.out}-profile-{shape}-{variant}.txt")] if variant == a.profile else [])]


def run_one(cmd: list[str], timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        tail = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else str(e.stderr or "")
        return {"error": f"timeout after {timeout:.0f} s", "stderr_tail": tail[-1500:], "wall_s": timeout}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}", "stderr_tail": (proc.stderr or proc.stdout)[-1500:],
                "wall_s": time.perf_counter() - t}
    return {**json.loads(lines[-1][7:]), "wall_s": time.perf_counter() - t}


def summarize(row: dict, params: int, counts: dict, rate: float) -> dict:
    if "steps_s" not in row:
        return row
    best = min(row["steps_s"])
    return {**row, "step_s": best, "completion_tokens_s": counts["completion_tokens"] / best,
            "tokens_s": counts["tokens"] / best, "mfu": 6 * params * counts["tokens"] / best / rate}


def logp_difference(scores: dict[str, Path]) -> dict[str, dict]:
    import numpy as np

    ref_path = scores.get("fp32")
    if ref_path is None or not ref_path.exists():
        return {}
    ref = np.load(ref_path)
    out = {}
    for v, path in scores.items():
        if v == "fp32" or not path.exists():
            continue
        got = np.load(path)
        if got.shape != ref.shape:
            out[v] = {"error": f"{got.size} log-probs against the reference's {ref.size}"}
            continue
        d = np.abs(got.astype(np.float64) - ref)
        out[v] = {"mean_abs": float(d.mean()), "max_abs": float(d.max())}
    return out


def targets(shape: str, rows: dict[str, dict], diff: dict[str, dict]) -> list[str]:
    """The issue's targets, checked on this shape's rows (those that ran)."""
    out = []
    ours, trl, today = rows.get("combined", {}), rows.get("trl", {}), rows.get("today", {})
    if "step_s" in ours and "step_s" in trl:
        x = trl["step_s"] / ours["step_s"]
        out.append(f"ours (combined) {x:.2f}x the plain HF step: {'met' if x >= SPEEDUP_TARGET else 'NOT met'} "
                   f"(target >= {SPEEDUP_TARGET}x)")
    if "mfu" in ours and shape in MFU_TARGET:
        out.append(f"MFU {ours['mfu']:.1%}: {'met' if ours['mfu'] >= MFU_TARGET[shape] else 'NOT met'} "
                   f"(target >= {MFU_TARGET[shape]:.0%})")
    if "peak_gib" in ours and "peak_gib" in today:
        ok = ours["peak_gib"] <= today["peak_gib"]
        out.append(f"peak {ours['peak_gib']:.1f} GiB vs today's {today['peak_gib']:.1f} GiB at the same budget: "
                   f"{'met' if ok else 'NOT met'}")
    if "combined" in diff and "today" in diff and "mean_abs" in diff["combined"] and "mean_abs" in diff["today"]:
        ok = diff["combined"]["max_abs"] <= 1.5 * diff["today"]["max_abs"]
        out.append(f"log-probs vs fp32: max {diff['combined']['max_abs']:.3f} vs today's {diff['today']['max_abs']:.3f} "
                   f"(tolerance: today's x1.5): {'met' if ok else 'NOT met'}")
    megatron = rows.get("megatron", {})
    if "step_s" in megatron and "step_s" in ours:
        x = megatron["step_s"] / ours["step_s"]
        out.append(f"megatron without TE {x:.2f}x the torch backend's step (combined): "
                   f"{'met' if x <= MEGATRON_TARGET else 'NOT met'} (target <= {MEGATRON_TARGET}x)")
    unshared = rows.get("combined_unshared", {})
    sdpa = rows.get("megatron_sdpa", {})
    if "step_s" in sdpa and "step_s" in unshared:  # the same tokens: megatron's sdpa path shares no prompts
        out.append(f"megatron_sdpa {sdpa['step_s'] / unshared['step_s']:.2f}x the torch backend's step on the "
                   f"same tokens (combined_unshared: every sample's prompt computed, as megatron's sdpa path does)")
    return out


def write_markdown(result: dict, path: Path) -> None:
    lines = [f"# Learner on {result['device']} ({result['date_utc']})", "",
             f"`{result['command']}`; torch {result['torch']}; bf16 matmul {result['bf16_matmul_flops'] / 1e12:.0f} "
             f"TFLOP/s (8192^3, this run); batch {result['batch']}; token budget {result['tokens']}.", ""]
    for shape, s in result["shapes"].items():
        lines += [f"## {shape}: {s['params'] / 1e6:.0f}M parameters, {s['counts']['samples']} samples, "
                  f"{s['counts']['tokens']:,} tokens ({s['counts']['completion_tokens']:,} completion)", "",
                  "| variant | step | completion tokens/s | MFU | peak GPU memory | log-prob vs fp32 (mean / max) | ran as |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for v, row in s["rows"].items():
            d = s["logp_diff"].get(v, {})
            dtext = f"{d['mean_abs']:.4f} / {d['max_abs']:.3f}" if "mean_abs" in d else d.get("error", "")
            if "step_s" in row:
                head = {True: "compiled", "triton": "triton"}.get(row.get("fused_head"), "eager")
                ran = (f"kernels {row.get('kernels', '-')}, head {head}, "
                       f"budget {row.get('micro_batch_tokens', result['tokens'])}, "
                       f"working copy {row.get('working_copy', '-')}, logits kept {row.get('keeps_logits', '-')}"
                       + (f", attention {row['megatron_attention']}" if row.get("megatron_attention") else "")
                       + (f", experts {row['experts']}, replay {row['routing_replay']}" if row.get("experts") else "")
                       ) if v != "trl" else "HF + autocast"
                lines.append(f"| {v} | {row['step_s']:.2f} s | {row['completion_tokens_s']:,.0f} | {row['mfu']:.1%} | "
                             f"{row['peak_gib']:.1f} GiB | {dtext} | {ran} |")
            else:
                why = row.get("error") or row.get("skipped") or ("reference" if v == "fp32" else "")
                lines.append(f"| {v} | - | - | - | - | {dtext} | {why} |")
        lines += ["", *[f"- {t}" for t in s["targets"]], *[f"- {n}" for n in s["notes"]], ""]
    path.write_text("\n".join(lines) + "\n")


def variants_for(option: str, shape: str) -> str:
    """--variants for one shape: 'a,b' (every shape) or 'SHAPE=a,b;SHAPE2=c' (a shape not named: its default)."""
    if "=" not in option:
        return option or DEFAULT_VARIANTS.get(shape, "fp32,today,combined,trl")
    per_shape = dict(item.split("=", 1) for item in option.split(";") if item.strip())
    return per_shape.get(shape) or DEFAULT_VARIANTS.get(shape, "fp32,today,combined,trl")


def profile_step(path: str, step) -> None:
    """One more step under torch.profiler: the top kernels and ops by CUDA time, to `path`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize() if torch.cuda.is_available() else None
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # the results folder may not exist yet
    Path(path).write_text(prof.key_averages().table(sort_by=sort, row_limit=45, max_name_column_width=70) + "\n")


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="learner step on CUDA (bench_learner.py --device cuda)")
    ap.add_argument("--device", choices=["cuda"], required=True)
    ap.add_argument("--out", default=f"gpu/{datetime.date.today().isoformat()}-learner",
                    help="results path under benchmarks/results, without the suffix")
    ap.add_argument("--dry-run", action="store_true", help="a tiny model and batch: seconds")
    ap.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--variants", default="", help=f"'a,b' for every shape or 'SHAPE=a,b;SHAPE2=c' ('' = "
                    f"{DEFAULT_VARIANTS}); known: {list(VARIANTS)}")
    ap.add_argument("--profile", default="", help="a variant whose child profiles one extra step (torch.profiler: "
                    "top kernels by CUDA time, to <out>-profile-<shape>-<variant>.txt)")
    ap.add_argument("--batch", default="64x8", help="PROMPTSxSAMPLES (the 1-GPU recipe: 64x8)")
    ap.add_argument("--max-completion", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=16384, help="micro_batch_tokens of every row but the *auto ones")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per child (the best counts)")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved rounds")
    ap.add_argument("--score-samples", type=int, default=32)
    ap.add_argument("--variant-timeout", type=float, default=110.0, help="seconds per child (the compiled head adds its compile to the first step)")
    ap.add_argument("--budget-s", type=float, default=230.0,
                    help="start no child expected to end past this many seconds (the longest child so far)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--force-cpu", action="store_true", help=argparse.SUPPRESS)  # the harness's own CPU check
    for name in ("--shape", "--variant", "--model-dir", "--score-file", "--profile-file"):
        ap.add_argument(name, help=argparse.SUPPRESS)
    ap.add_argument("--prompts", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--group-size", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if not a.child:
        try:
            a.prompts, a.group_size = (int(x) for x in a.batch.lower().split("x"))
        except ValueError:
            ap.error(f"--batch '{a.batch}': expected PROMPTSxSAMPLES, e.g. 64x8")
    return a


def main(argv: list[str]) -> int:
    a = parse(argv)
    if a.child:
        run_child(a)
        return 0
    import torch

    if not torch.cuda.is_available() and not a.force_cpu:
        print("SKIP: no CUDA device (torch.cuda.is_available() is False)", flush=True)
        return SKIP_RC
    t_start = time.perf_counter()
    if a.dry_run:  # the tiny shapes asked for; else tiny-vl for a VLM, tiny-moe for an MoE shape, tiny for a dense one
        asked = [s for s in a.shapes.split(",") if s in SHAPES]
        tiny = [s for s in asked if s.startswith("tiny")] or [
            "tiny-vl" if any(is_vl(s) for s in asked) else "tiny-moe" if any(moe_of(s) for s in asked) else "tiny"]
        a.shapes, a.prompts, a.group_size, a.max_completion = ",".join(tiny), 4, 4, 64
        a.tokens, a.score_samples, a.variant_timeout = 2048, 8, 120.0
    cuda = torch.cuda.is_available()
    rate = matmul_rate() if cuda else float("nan")
    torch.cuda.empty_cache() if cuda else None
    tmp = Path(tempfile.mkdtemp(prefix="bench_learner_gpu_"))
    result = {"date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "command": "python benchmarks/bench_learner.py " + " ".join(argv),
              "device": torch.cuda.get_device_name(0) if cuda else "cpu (harness check)", "torch": torch.__version__,
              "bf16_matmul_flops": rate, "batch": f"{a.prompts}x{a.group_size}", "tokens": a.tokens, "shapes": {}}
    longest: list[float] = []  # every child's wall time so far
    for shape in a.shapes.split(","):
        if shape not in SHAPES:
            print(f"--shapes: unknown '{shape}'; known: {list(SHAPES)}", file=sys.stderr)
            return 2
        variants = variants_for(a.variants, shape).split(",")
        unknown = [v for v in variants if v not in VARIANTS]
        if unknown:
            print(f"--variants: unknown {unknown}; known: {list(VARIANTS)}", file=sys.stderr)
            return 2
        t = time.perf_counter()
        model_dir = tmp / shape
        params = make_model(model_dir, shape)
        torch.cuda.empty_cache() if cuda else None
        groups = groups_of(shape, model_dir, a.prompts, a.group_size, a.max_completion)
        counts = batch_counts(groups)
        print(f"{shape}: {params / 1e6:.0f}M parameters (made in {time.perf_counter() - t:.0f} s), {counts}", flush=True)
        runs: dict[str, list[dict]] = {}
        scores: dict[str, Path] = {}
        notes: list[str] = []
        for rnd in range(a.repeats):
            for v in variants:
                if v == "fp32" and rnd > 0:
                    continue
                # A child's expected time: the longest so far on any shape (its timeout before any ran): a
                # larger shape's children take longer, so this shape's own longest would start one too many.
                expect = max(longest, default=a.variant_timeout)
                if time.perf_counter() - t_start + expect > a.budget_s and not a.dry_run:
                    runs.setdefault(v, []).append({"skipped": f"time budget ({a.budget_s:.0f} s) spent"})
                    continue
                score = tmp / f"{shape}-{v}-{rnd}.npy"
                row = run_one(child_command(a, shape, v, model_dir, score), a.variant_timeout)
                if rnd == 0 and score.exists():
                    scores[v] = score
                runs.setdefault(v, []).append(row)
                longest.append(row.get("wall_s", 0.0))
                notes += [n for n in row.get("notes", []) if n not in notes]
                brief = (f"step {min(row['steps_s']):.2f} s, peak {row['peak_gib']:.1f} GiB" if "steps_s" in row
                         else row.get("error") or row.get("skipped") or "scored")
                print(f"  round {rnd} {v}: {brief} [{row.get('wall_s', 0):.0f} s]", flush=True)
                if "error" in row:
                    print(row.get("stderr_tail", ""), file=sys.stderr, flush=True)
        rows = {}
        for v, rs in runs.items():
            timed = [r for r in rs if "steps_s" in r]
            if timed:
                merged = {**timed[0], "steps_s": [s for r in timed for s in r["steps_s"]],
                          "peak_gib": max(r["peak_gib"] for r in timed)}
                rows[v] = summarize(merged, params, counts, rate)
            else:
                rows[v] = rs[0]
        diff = logp_difference(scores)
        result["shapes"][shape] = {"params": params, "counts": counts, "rows": rows, "logp_diff": diff,
                                   "targets": targets(shape, rows, diff), "notes": notes}
        # Written after every shape: a run killed later (a part's timeout) keeps what it measured.
        out = RESULTS / a.out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        write_markdown(result, out.with_suffix(".md"))
    print(out.with_suffix(".md").read_text())
    print(f"wrote {out.with_suffix('.json')} and .md in {time.perf_counter() - t_start:.0f} s", flush=True)
    return 0
