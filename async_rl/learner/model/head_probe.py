"""`learner.head_kernel: auto` on CUDA: the chunked head's kernel measured at start-up, the fastest kept.

Which of the head's per-chunk kernels is fastest depends on the GPU, the vocabulary and the compiler:
on an H200 with Qwen2.5's 151,936-token vocabulary the compiled head's statistics reduction ran at ~2%
of the memory bandwidth and the eager loop beat it (`benchmarks/results/gpu/2026-11-27d-h200.md`),
which a fixed default cannot know. So each learner times the candidates once, on its own GPU and its
own output layer: the forward (with the entropy, as training computes it) and the backward of the
log-probs over two chunks of random hidden states, each kernel warmed up first (that compiles it), then
the best of a few timed calls. Ranks agree on the slowest rank's times (`agreed`), so every rank runs
the same kernel. A candidate that cannot run here (triton without CUDA or without triton) or that
raises is reported and left out; eager always runs. The decision is one line at start-up (`line`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from async_rl.errors import typed_line
from async_rl.learner.model import head_fused, head_triton
from async_rl.learner.model.head import ChunkedHead

# learner.head_kernel's concrete kernels, as the head's `fused` argument (head_fused.fused_setting).
FUSED = {"eager": False, "compiled": True, "triton": "triton"}
REPEATS = 3


@dataclass(frozen=True)
class HeadProbe:
    """What the start-up probe measured: seconds per forward + backward of `positions` positions over
    a `vocab`-column output layer, per kernel; `failed`: the kernels that could not run, and why;
    `configs`: how a kernel with choices of its own ran (triton: the autotuner's block and warps)."""

    positions: int
    vocab: int
    seconds: dict[str, float]
    failed: dict[str, str] = field(default_factory=dict)
    configs: dict[str, str] = field(default_factory=dict)

    @property
    def fastest(self) -> str:
        """The kernel with the shortest time (eager where nothing else ran)."""
        return min(self.seconds, key=self.seconds.__getitem__) if self.seconds else "eager"

    def agreed(self, reduce_max: Callable[[torch.Tensor], torch.Tensor]) -> HeadProbe:
        """The probe with each kernel's time replaced by its maximum over ranks (`reduce_max`: an
        all-reduce of a float64 [kernels] tensor, every rank passing the kernels in FUSED's order), so
        that every rank picks the same kernel; a kernel that failed on any rank is dropped."""
        names = list(FUSED)
        local = torch.tensor([self.seconds.get(n, float("inf")) for n in names], dtype=torch.float64)
        worst = reduce_max(local).tolist()
        seconds = {n: s for n, s in zip(names, worst, strict=True) if s != float("inf")}
        failed = {n: self.failed.get(n, "failed on another rank") for n in names if n not in seconds}
        return HeadProbe(self.positions, self.vocab, seconds, failed, self.configs)

    def line(self) -> str:
        """The start-up line: the kernel chosen and every measurement."""
        times = ", ".join(f"{n} {s * 1e3:.2f} ms" + (f" ({self.configs[n]})" if n in self.configs else "")
                          for n, s in sorted(self.seconds.items(), key=lambda x: x[1]))
        out = (f"learner.head_kernel auto: {self.fastest}, the fastest here (forward + backward of {self.positions:,} "
               f"positions over {self.vocab:,} columns: {times})")
        if self.failed:
            out += "; not run: " + "; ".join(f"{n}: {why}" for n, why in self.failed.items())
        return out


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fused: head_fused.FusedPath, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
             chunk: int, repeats: int) -> float:
    """The best of `repeats` timed forward + backward calls of the head with kernel `fused`, after one
    untimed call (the compile)."""
    best = float("inf")
    for k in range(repeats + 1):
        hidden.grad = weight.grad = None
        _synchronize(hidden.device)
        t = time.perf_counter()
        logp, _ = ChunkedHead.apply(hidden, weight, targets, 1.0, chunk, True, fused)
        logp.sum().backward()
        _synchronize(hidden.device)
        if k:
            best = min(best, time.perf_counter() - t)
    return best


def measure(weight: torch.Tensor, chunk: int, dtype: torch.dtype, kernels: tuple[str, ...] = tuple(FUSED),
            repeats: int = REPEATS, seed: int = 0) -> HeadProbe:
    """Time each of `kernels` on the output layer `weight` [V, H] (used as it is, not changed: a
    detached view of it takes the gradient) over two chunks of `chunk` positions whose hidden states
    are random in `dtype` (the learner's compute dtype)."""
    device = weight.device
    positions = 2 * chunk
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(positions, weight.shape[1], generator=g, device=device, dtype=dtype).requires_grad_()
    targets = torch.randint(0, weight.shape[0], (positions,), generator=g, device=device)
    w = weight.detach().requires_grad_()
    seconds, failed = {}, {}
    for name in kernels:
        if name == "triton" and (why := head_triton.unavailable(device.type)):
            failed[name] = why
            continue
        try:
            seconds[name] = _seconds(FUSED[name], hidden, w, targets, chunk, repeats)
        except Exception as e:  # noqa: BLE001 - a kernel that does not build or run here is not chosen
            failed[name] = typed_line(e)
    configs = {"triton": config} if "triton" in seconds and (config := head_triton.tuned()) else {}
    return HeadProbe(positions, int(weight.shape[0]), seconds, failed, configs)



def agreed_measure(weight: torch.Tensor, chunk: int, dtype: torch.dtype,
                   reduce_max: Callable[[torch.Tensor], torch.Tensor], announce: bool) -> HeadProbe:
    """A backend's start-up probe: `measure`, agreed over its data-parallel ranks (`reduce_max`), its line
    printed where `announce` (rank 0)."""
    probe = measure(weight, chunk, dtype).agreed(reduce_max)
    if announce:
        print(f"[learner] {probe.line()}", file=sys.stderr, flush=True)
    return probe


def chosen(probe: HeadProbe | None, setting: str, device_type: str) -> tuple[str, head_fused.FusedPath]:
    """(the kernel's name, the head's `fused` argument): the probe's fastest, or `learner.head_kernel`
    where nothing was measured (`head_fused.kernel_name`)."""
    kernel = probe.fastest if probe else head_fused.kernel_name(setting, device_type)
    return kernel, head_fused.fused_setting(kernel, device_type)
