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
        apply_liger(model)
    else:
        restore_hf_rope(model)
        if kind == "compile":
            compile_layers(model)
    return kind


# The HF modeling module's names Liger's patch rebinds for every model built after it in the process
# (module name -> attribute names), and the HF RoPE functions it replaced (module name -> function).
LIGER_REBOUND_CLASSES = {"llama": ("LlamaRMSNorm", "LlamaMLP"), "qwen2": ("Qwen2RMSNorm", "Qwen2MLP")}
_hf_rope: dict[str, object] = {}


def modeling_module(model_type: str) -> str:
    return f"transformers.models.{model_type}.modeling_{model_type}"


def apply_liger(model: torch.nn.Module) -> None:
    """Liger's RMSNorm and SwiGLU on this instance's modules, its RoPE for the model's modeling module.
    Liger's patch also rebinds the modeling module's norm and MLP classes, so every model built later in
    the process (a `none` or `compile` model in the same test process, a reference model) would get
    Liger's modules too: those names are put back. Its RoPE is the module's function, looked up at call
    time, so it is process-wide by nature: `restore_hf_rope` puts HF's back for a later model that asks
    for none or compile (the values are the same; dynamo cannot trace Liger's autograd functions)."""
    import importlib

    import liger_kernel.transformers as liger

    kind = model.config.model_type
    module = importlib.import_module(modeling_module(kind))  # what Liger patches (also under a PEFT wrapper)
    saved = {name: getattr(module, name) for name in LIGER_REBOUND_CLASSES[kind]}
    _hf_rope.setdefault(module.__name__, module.apply_rotary_pos_emb)
    # The head stays ours (see the module docstring).
    getattr(liger, LIGER_PATCHES[kind])(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                        fused_linear_cross_entropy=False, model=model)
    for name, value in saved.items():
        setattr(module, name, value)


def restore_hf_rope(model: torch.nn.Module) -> None:
    """HF's RoPE back in the model's modeling module if Liger's replaced it earlier in this process."""
    import sys

    kind = getattr(model.config, "model_type", "")
    module = sys.modules.get(modeling_module(kind)) if kind in LIGER_PATCHES else None
    if module is not None and (original := _hf_rope.get(module.__name__)) is not None:
        if module.apply_rotary_pos_emb is not original:
            print(f"[learner] learner.kernels: {module.__name__}.apply_rotary_pos_emb is HF's again (Liger's RoPE "
                  "was set by an earlier model in this process)", flush=True)
            module.apply_rotary_pos_emb = original
