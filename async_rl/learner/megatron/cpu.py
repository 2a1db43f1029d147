"""What megatron-core needs to run forward, backward and its optimizer on CPU (gloo), for tests and
for debugging a Megatron RL run on a machine without a GPU.

Pinned to megatron-core VERIFIED_VERSION. megatron-core builds a GPTModel on CPU with
`use_cpu_initialization=True`, but a few places allocate on CUDA unconditionally. Each patch below
names the place it covers; together they are all that forward, backward (TP and PP over gloo) and
the fp32 optimizer step reach in that version:

- `torch.cuda.current_device()` is the device of the RoPE frequencies, the attention's causal-mask
  buffers, the pipeline's receive buffers and DDP's grad buffers: it answers "cpu". It is also where
  an MoE router's `gating` moves its weight (and bias) before every forward, unconditionally
  (`Router.gating`, router.py:88-92: meant for a router initialised on the CPU and trained on CUDA):
  the move is then to the CPU, a no-op that keeps the parameter DDP's grad buffer holds.
- `tensor_parallel.get_cuda_rng_tracker().fork()` wraps attention dropout and reads the CUDA RNG:
  a tracker whose fork does nothing (the CPU path runs with dropout 0; `check_config` enforces it).
  Activation recompute (`tensor_parallel.random.CheckpointFunction`, learner.activation_checkpointing)
  saves and restores the CUDA RNG state and the tracker's around each recomputed layer: in that
  module the tracker is the same stand-in and the CUDA RNG state is none (the CPU RNG it keeps too).
- the pipeline schedules (a token counter), the fp32 optimizer (its loss scale), gradient
  clipping (norm buffers) and `utils.local_multi_tensor_l2_norm` (the grad norm without Apex) call
  torch factories with the literal `device="cuda"`: in those four modules `torch` is a view of torch whose factories put "cuda" tensors on the CPU.
- `torch.cuda.synchronize` (after pipeline sends) does nothing, and `Tensor.cuda()` (the tied
  embedding of the last pipeline stage, `LanguageModule.setup_embeddings_and_output_layer`) returns
  the tensor where it is.
- `clip_grad_by_total_norm_fp32`, as the optimizer module imported it, asserts that every gradient
  is a `torch.cuda.FloatTensor`: `_clip_grads_by_total_norm` does the same scaling without it.

Not covered, refused by `check_config`: bf16/fp16 (megatron's mixed-precision optimizer checks
`param.type() == 'torch.cuda.*Tensor'`), the distributed optimizer (same checks), Transformer
Engine, dropout. Batched p2p (`batch_isend_irecv`) is switched off in the model config on CPU.

`enable()` applies the patches to the whole process (a learner rank on CPU is a process of its own;
Ray runs its methods in several threads, so a thread-local mode would not do). `patched()` applies
them for a `with` block (single-process tests). `check_targets()` lists what an upgrade moved.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Iterator
from importlib.metadata import version
from types import ModuleType
from typing import Any
from unittest import mock

import torch

VERIFIED_VERSION = "0.16.1"

# module -> why its literal device="cuda" factories are redirected
_CUDA_LITERAL_MODULES = {
    "megatron.core.pipeline_parallel.schedules": "token counter of the pipeline schedules",
    "megatron.core.optimizer.optimizer": "FP32Optimizer's loss scale",
    "megatron.core.optimizer.clip_grads": "gradient-norm buffers of clip_grad_norm_fp32",
    "megatron.core.utils": "local_multi_tensor_l2_norm, the gradient norm without Apex",
}
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange")


class CpuSupportError(RuntimeError):
    """megatron-core changed where our CPU patches apply; the message names the version and place."""


class _NoCudaRngTracker:
    """Stands in for megatron's CUDA RNG tracker: dropout is 0 on CPU, there is no state to fork."""

    def fork(self, name: str = "model-parallel-rng") -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def add(self, name: str, seed: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def get_states(self) -> dict[str, Any]:
        return {}

    def set_states(self, states: dict[str, Any]) -> None:
        pass


def _cpu_device(device: Any) -> Any:
    if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
        return "cpu"
    return device


class _TorchOnCpu(ModuleType):
    """`torch` as seen by one megatron module: factories given device "cuda" allocate on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name not in _FACTORIES:
            return attr

        def factory(*args: Any, device: Any = None, **kwargs: Any) -> Any:
            return attr(*args, device=_cpu_device(device), **kwargs)

        return factory


def _clip_grads_by_total_norm(
    parameters: list[torch.Tensor], max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """megatron's clip_grad_by_total_norm_fp32 minus its CUDA type assertion: scale the gradients in
    place by max_norm / total_norm when that is below 1."""
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff >= 1.0:
        return
    with torch.no_grad():
        for p in parameters:
            g = getattr(p, "decoupled_grad", None) if use_decoupled_grad else p.grad
            if g is not None:
                g.mul_(clip_coeff)


def _stay(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


def installed_version() -> str:
    return version("megatron-core")


def check_targets() -> list[str]:
    """What the patches rely on and megatron-core no longer has (empty when all is in place)."""
    problems = []
    for name, why in _CUDA_LITERAL_MODULES.items():
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            problems.append(f"{name} ({why}) is gone: {e}")
            continue
        if getattr(module, "torch", None) is not torch and not isinstance(getattr(module, "torch", None), _TorchOnCpu):
            problems.append(f"{name} ({why}) no longer imports torch as a module attribute")
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import optimizer

    if not callable(getattr(optimizer, "clip_grad_by_total_norm_fp32", None)):
        problems.append("megatron.core.optimizer.optimizer no longer calls clip_grad_by_total_norm_fp32")
    if not callable(getattr(tensor_parallel, "get_cuda_rng_tracker", None)):
        problems.append("megatron.core.tensor_parallel.get_cuda_rng_tracker is gone")
    from megatron.core.tensor_parallel import random as tp_random

    for name in ("_get_cuda_rng_state", "_set_cuda_rng_state", "get_cuda_rng_tracker"):
        if not callable(getattr(tp_random, name, None)):
            problems.append(f"megatron.core.tensor_parallel.random.{name} (activation recompute's RNG states) is gone")
    from megatron.core.transformer.moe.router import Router

    if "torch.cuda.current_device()" not in inspect.getsource(Router.gating):
        problems.append("Router.gating no longer takes its weight's device from torch.cuda.current_device()")
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    if "torch.cuda.current_device()" not in inspect.getsource(rotary_pos_embedding):
        problems.append("rotary_pos_embedding no longer takes its device from torch.cuda.current_device()")
    return problems


def check_config(*, dtype: torch.dtype, distributed_optimizer: bool, te_spec: bool) -> None:
    """Refuse, in one line, what the CPU patches do not cover."""
    if dtype != torch.float32:
        raise CpuSupportError(f"megatron on CPU runs in float32 only (got {dtype}): set model.dtype=float32")
    if distributed_optimizer:
        raise CpuSupportError(
            "megatron on CPU: the distributed optimizer checks for CUDA tensors; set "
            "learner.megatron.distributed_optimizer=false"
        )
    if te_spec:
        raise CpuSupportError("megatron on CPU: Transformer Engine needs CUDA; set learner.megatron.transformer_engine=off")


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """The CPU patches for the duration of a `with` block (see the module docstring)."""
    found = installed_version()
    if found != VERIFIED_VERSION:
        raise CpuSupportError(
            f"megatron-core {found} is installed; async_rl.learner.megatron.cpu is verified with "
            f"{VERIFIED_VERSION} only: run tests/unit/test_megatron_cpu.py and update VERIFIED_VERSION"
        )
    problems = check_targets()
    if problems:
        raise CpuSupportError(f"megatron-core {found}: " + "; ".join(problems))
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import optimizer
    from megatron.core.tensor_parallel import random as tp_random

    tracker = _NoCudaRngTracker()
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: "cpu"))
        stack.enter_context(mock.patch.object(torch.cuda, "synchronize", lambda device=None: None))
        stack.enter_context(mock.patch.object(torch.Tensor, "cuda", _stay))
        stack.enter_context(mock.patch.object(tensor_parallel, "get_cuda_rng_tracker", lambda *a, **k: tracker))
        stack.enter_context(mock.patch.object(tp_random, "get_cuda_rng_tracker", lambda *a, **k: tracker))
        stack.enter_context(mock.patch.object(tp_random, "_get_cuda_rng_state", lambda *a, **k: None))
        stack.enter_context(mock.patch.object(tp_random, "_set_cuda_rng_state", lambda *a, **k: None))
        stack.enter_context(mock.patch.object(optimizer, "clip_grad_by_total_norm_fp32", _clip_grads_by_total_norm))
        for name in _CUDA_LITERAL_MODULES:
            stack.enter_context(mock.patch.object(importlib.import_module(name), "torch", _TorchOnCpu()))
        yield


_enabled: contextlib.ExitStack | None = None


def enable() -> None:
    """Apply the CPU patches to this whole process (idempotent)."""
    global _enabled
    if _enabled is None:
        stack = contextlib.ExitStack()
        stack.enter_context(patched())
        _enabled = stack
