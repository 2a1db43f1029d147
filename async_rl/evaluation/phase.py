"""The evaluation phase of the training loop: when to evaluate, on what, and how it is fanned out.

The controller calls `Evaluation.maybe_run` between steps (after the weight sync, so every engine
holds the version being evaluated). The eval prompts are split across the engines; each engine
generates and scores its share beside its training requests and returns small results to the
controller. Nothing goes to the buffer: eval samples never enter training or its accounting.
"""

from __future__ import annotations

import itertools
import time

import msgspec
import ray
from ray.actor import ActorHandle

from async_rl.config import Config, EvalConfig
from async_rl.errors import ConfigError, RunError
from async_rl.evaluation.scores import EvalBatch, EvalParams, EvalRecord, make_record
from async_rl.protocol import Prompt
from async_rl.tasks.base import load_task


def eval_prompts(cfg: Config) -> list[Prompt]:
    """The eval set: the task's held-out prompts (the data-source loader replaces this for eval files)."""
    return task_eval_prompts(cfg)


def task_eval_prompts(cfg: Config) -> list[Prompt]:
    """The task's prompt stream under the held-out seed `eval.seed` (the training stream uses
    `task.seed`): the first `eval.max_prompts` prompts, tagged with the task's name as data source."""
    if cfg.eval.max_prompts == 0:
        raise ConfigError("eval.max_prompts=0 (all) needs an eval file; a task's held-out prompt stream is endless")
    task = load_task(cfg.task.name)
    prompts = list(itertools.islice(task.prompts(cfg.eval.seed), cfg.eval.max_prompts))
    return [p if p.data_source else msgspec.structs.replace(p, data_source=task.name) for p in prompts]


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
