"""Colocated placement on a GPU: the learner's memory hand-off before vLLM wakes up on the same GPU.

The engines slept (weights offloaded, KV cache dropped) while the learner trained; the weight sync
wakes them, and vLLM maps its weights and KV cache back into the memory the learner just trained in.
Before that the learner gives back what it holds but does not need between steps: its gradients
(every backend zeroes them at the start of the next step anyway) and torch's cached blocks that no
tensor uses (activations of the step just done). Parameters and optimizer state stay resident (no
offload: moving Adam's moments over PCIe twice per step costs more than the memory it frees), so
`generators.gpu_memory_utilization` must leave the learner room for those.
"""

from __future__ import annotations

import gc

import torch


def optimizers_of(*owners: object) -> list[torch.optim.Optimizer]:
    """The torch optimizers held as attributes of `owners` (a backend: its policy's optimizer)."""
    found: list[torch.optim.Optimizer] = []
    for owner in owners:
        for value in vars(owner).values() if hasattr(owner, "__dict__") else ():
            if isinstance(value, torch.optim.Optimizer) and value not in found:
                found.append(value)
    return found


def release(optimizers: list[torch.optim.Optimizer], drop_grads: bool) -> int:
    """Drop gradients (`drop_grads`: only between steps, never while one runs) and return torch's
    unused cached CUDA blocks to the driver. Returns the bytes the process no longer reserves."""
    if drop_grads:
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
    gc.collect()  # tensors of the last step held only by reference cycles
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    before = torch.cuda.memory_reserved()
    torch.cuda.synchronize()  # blocks still used by queued kernels are freed once those finish
    torch.cuda.empty_cache()
    return before - torch.cuda.memory_reserved()
