"""Autoscaling policy for the generator pool: a pure function of measured signals.

Two signals, both measured every step:

- learner wait fraction: the share of the step the learner spent waiting for its batch. High means
  the generators do not keep up (the learner is starved): grow.
- buffer fill: complete groups waiting after the step, in batches. With the learner not waiting and
  a full batch or more already waiting, the generators sit idle on admission (the staleness bound
  stops them): shrink.

Decisions use the mean over the last `window_steps` steps and wait `cooldown_steps` after a change,
because a new engine needs time to start and to show in the numbers.
"""

from __future__ import annotations

import msgspec

from async_rl.config import AutoscaleConfig


class ScaleSignal(msgspec.Struct, frozen=True):
    """What one step measured."""

    step_s: float  # wall time of the step
    learner_wait_s: float  # of which the learner waited for its batch
    waiting_groups: int  # complete groups in the buffer after the step
    prompts_per_step: int  # groups in one batch

    @property
    def wait_frac(self) -> float:
        return self.learner_wait_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def fill_batches(self) -> float:
        return self.waiting_groups / self.prompts_per_step


class ScaleDecision(msgspec.Struct, frozen=True):
    engines: int  # the pool size wanted (== the current size when nothing changes)
    reason: str  # why, in one line (also when nothing changes)

    def changes(self, current: int) -> bool:
        return self.engines != current


def decide(
    policy: AutoscaleConfig, window: list[ScaleSignal], engines: int, steps_since_change: int
) -> ScaleDecision:
    """The pool size the policy wants, and why. Pure: same inputs, same answer."""
    lo, hi = policy.min_engines, policy.max_engines
    if engines < lo:
        return ScaleDecision(lo, f"grow {engines}->{lo}: below autoscale.min_engines")
    if engines > hi:
        return ScaleDecision(hi, f"shrink {engines}->{hi}: above autoscale.max_engines")
    if len(window) < policy.window_steps:
        measuring = f"{len(window)}/{policy.window_steps} steps"
        return ScaleDecision(engines, f"hold {engines}: measuring ({measuring})")
    if steps_since_change < policy.cooldown_steps:
        return ScaleDecision(engines, f"hold {engines}: cooldown ({steps_since_change}/{policy.cooldown_steps} steps)")
    recent = window[-policy.window_steps :]
    wait = sum(s.wait_frac for s in recent) / len(recent)
    fill = sum(s.fill_batches for s in recent) / len(recent)
    measured = f"learner wait {wait:.0%} of step, buffer fill {fill:.2f} batches"
    if wait >= policy.grow_wait_frac:
        if engines >= hi:
            return ScaleDecision(engines, f"hold {engines}: starved ({measured}) but at autoscale.max_engines")
        target = min(hi, engines + policy.step_engines)
        return ScaleDecision(target, f"grow {engines}->{target}: learner starved ({measured})")
    if wait <= policy.shrink_wait_frac and fill >= policy.shrink_fill_batches:
        if engines <= lo:
            return ScaleDecision(engines, f"hold {engines}: generators ahead ({measured}) but at autoscale.min_engines")
        target = max(lo, engines - policy.step_engines)
        return ScaleDecision(target, f"shrink {engines}->{target}: generators idle on admission ({measured})")
    return ScaleDecision(engines, f"hold {engines}: balanced ({measured})")
