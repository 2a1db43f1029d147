"""`learner.kernels`: faster kernels for the decoder layers of the torch backend's HF model.

  liger    Liger-Kernel's Triton RMSNorm, RoPE and SwiGLU for Llama and Qwen2 models (CUDA; the package
           `liger-kernel`, imported only here and only when asked for). Its fused linear cross-entropy is
           not used: it computes the gradient in the forward for a loss fixed there, while our RL losses
           are functions of the log-probs the head returns (`head.ChunkedHead` recomputes in backward).
  compile  regional torch.compile: every decoder layer compiled in place, one graph for the repeated block
           (dynamic shapes: micro-batches differ in length).
  none     the model's own eager modules.
  auto     none on CPU; on CUDA liger where it imports and the model is a Llama or Qwen2, else none.
           Chosen without a GPU measurement (benchmarks/bench_learner.py --device cuda measures each):
           liger's kernels are drop-in modules with no warm-up, compile pays tens of seconds per new run.
"""

from __future__ import annotations

from typing import Literal

import torch

from async_rl.errors import RunError

Kernels = Literal["auto", "liger", "compile", "none"]
# model_type -> the Liger entry point that patches it (liger_kernel.transformers)
LIGER_PATCHES = {"llama": "apply_liger_kernel_to_llama", "qwen2": "apply_liger_kernel_to_qwen2"}


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks FSDP2 shards one by one (HF names their class in `_no_split_modules`)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def compile_layers(model: torch.nn.Module) -> None:
    """torch.compile every decoder layer in place. The layers are one class, so they share one compiled
    graph (compiled once, not 30 times); the head and the loss stay eager (the chunked head is a Python
    loop over chunks). Before DDP/FSDP2 wrap the model, as they expect."""
    layers = decoder_layers(model)
    if not layers:
        raise RunError("learner.kernels=compile: the model names no decoder layer class (_no_split_modules) to compile")
    for layer in layers:
        layer.compile(dynamic=True)


def liger_unavailable(model: torch.nn.Module, device: torch.device) -> str | None:
    """Why Liger's kernels cannot run here (None when they can)."""
    if device.type != "cuda":
        return "its Triton kernels need CUDA"
    kind = getattr(model.config, "model_type", "")
    if kind not in LIGER_PATCHES:
        return f"model_type '{kind}' is not one of {sorted(LIGER_PATCHES)}"
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError as e:
        return f"liger_kernel does not import ({e}); pip install liger-kernel"
    return None


def resolve(choice: Kernels, model: torch.nn.Module, device: torch.device) -> Literal["liger", "compile", "none"]:
    if choice == "auto":
        return "liger" if liger_unavailable(model, device) is None else "none"
    return choice


def apply_kernels(choice: Kernels, model: torch.nn.Module, device: torch.device) -> str:
    """Apply `learner.kernels` to `model` (the module the forward runs on) in place; returns what ran."""
    kind = resolve(choice, model, device)
    if kind == "liger":
        if why := liger_unavailable(model, device):
            raise RunError(f"learner.kernels=liger: {why}; set learner.kernels to compile or none")
        import liger_kernel.transformers as liger

        patch = getattr(liger, LIGER_PATCHES[model.config.model_type])
        # The head stays ours (see the module docstring); the instance's norms and MLPs are swapped.
        patch(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False,
              model=model)
    elif kind == "compile":
        compile_layers(model)
    return kind
