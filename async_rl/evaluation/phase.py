"""The evaluation phase of the training loop: when to evaluate, on what, and how it is fanned out.

`Controller.evaluate` asks `Evaluation.due` between steps and then calls `Evaluation.run` (after
the weight sync, so every engine holds the version being evaluated). The eval prompts are split across the engines; each engine
generates and scores its share beside its training requests and returns small results to the
controller. Nothing goes to the buffer: eval samples never enter training or its accounting.
"""

from __future__ import annotations

import collections
import time
from pathlib import Path

import ray
from ray.actor import ActorHandle

from async_rl.config import Config, EvalConfig
from async_rl.data import load_eval_prompts
from async_rl.errors import ConfigError, RunError
from async_rl.evaluation.scores import EvalBatch, EvalParams, EvalRecord, make_record
from async_rl.protocol import Prompt


def eval_prompts(cfg: Config, model_dir: str | Path) -> list[Prompt]:
    """The eval set, rendered with the model's chat template: the rows of `data.eval_files`, or the
    task's held-out prompt stream (`data.eval_task_seed`, `data.eval_task_prompts`); the first
    `eval.max_prompts` of them (0 = all). Bad rows follow `data.skip_bad_rows`."""
    skipped: collections.Counter[str] = collections.Counter()
    prompts = load_eval_prompts(cfg, model_dir, skipped)
    if cfg.eval.max_prompts:
        prompts = prompts[: cfg.eval.max_prompts]
    if not prompts:
        raise ConfigError(f"eval.enabled: the eval set is empty (skipped: {dict(skipped) or 'none'})")
    return prompts


def split(prompts: list[Prompt], parts: int) -> list[list[Prompt]]:
    """Round-robin shares, one per engine (a share may be empty when prompts < engines)."""
    return [prompts[i::parts] for i in range(parts)]


class Evaluation:
    def __init__(self, cfg: EvalConfig, prompts: list[Prompt], default_max_tokens: int, total_steps: int) -> None:
        self.cfg = cfg
        self.prompts = prompts
        self.params = EvalParams(n=cfg.n, temperature=cfg.temperature, max_tokens=cfg.max_tokens or default_max_tokens)
        self.total_steps = total_steps
        self.last_step = -1  # the step last evaluated (never twice for the same weights)

    def due(self, step: int, at_start: bool = False) -> bool:
        """`step` optimizer steps are done. At the start, every `every` steps, and after the last."""
        c = self.cfg
        if not c.enabled or step == self.last_step:
            return False
        if at_start:
            return c.at_start
        return (c.every > 0 and step % c.every == 0) or (c.at_end and step == self.total_steps)

    def run(self, engines: list[ActorHandle], step: int, elapsed_s: float) -> EvalRecord:
        """Generate and score the eval set on `engines` (every one holds policy version `step`)."""
        t0 = time.perf_counter()
        shares = split(self.prompts, len(engines))
        refs = [e.evaluate.remote(share, self.params) for e, share in zip(engines, shares, strict=True) if share]
        try:
            batches: list[EvalBatch] = ray.get(refs, timeout=self.cfg.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RunError(f"evaluation at step {step} took longer than eval.timeout_s={self.cfg.timeout_s:.0f}s") from None
        self.last_step = step
        return make_record(batches, self.cfg.pass_threshold, step, elapsed_s, time.perf_counter() - t0)
