"""Learning-rate schedule: linear warmup, then constant, linear or cosine decay to a floor."""

from __future__ import annotations

import math


def lr_factor(step: int, warmup_steps: int, total_steps: int, decay: str, min_ratio: float) -> float:
    """Multiplier of the base learning rate for optimizer step `step` (0-based).

    Warmup: (step + 1) / warmup_steps for the first `warmup_steps` steps, so step 0 already moves
    the weights. Decay: from 1 after warmup to `min_ratio` at the last step (`total_steps - 1`).
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant":
        return 1.0
    span = max(1, total_steps - 1 - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / span))
    if decay == "linear":
        shape = 1.0 - progress
    elif decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"learner.lr_decay: unknown schedule '{decay}'")
    return min_ratio + (1.0 - min_ratio) * shape
