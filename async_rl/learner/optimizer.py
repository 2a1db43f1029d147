"""The torch backend's AdamW, with the implementation (kernel) chosen for speed.

torch's AdamW has three implementations of the same update: `for_loop` (one parameter at a time,
a handful of elementwise ops each; torch's default on CPU, where `foreach` is off unless asked),
`foreach` (the same ops over lists of tensors) and `fused` (one kernel per parameter group that
reads each parameter, gradient and moment once). They compute the same update up to the order of
float roundings (`tests/unit/test_optimizer.py`). `benchmarks/bench_adamw.py` measured them on
SmolLM2-135M's parameters (fp32, 2 threads; benchmarks/results/adamw.json): `fused` is the fastest
on CPU, and torch has it on CUDA too, so it is the default everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch

AdamWKernel = Literal["for_loop", "foreach", "fused"]
ADAMW_KERNELS: tuple[AdamWKernel, ...] = ("for_loop", "foreach", "fused")
DEFAULT_KERNEL: AdamWKernel = "fused"
BETAS = (0.9, 0.99)


def adamw(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float,
          kernel: AdamWKernel = DEFAULT_KERNEL) -> torch.optim.AdamW:
    """AdamW over `params` with the backend's betas, run by `kernel`."""
    flags = {"for_loop": {"foreach": False, "fused": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    return torch.optim.AdamW(list(params), lr=lr, weight_decay=weight_decay, betas=BETAS, **flags[kernel])
