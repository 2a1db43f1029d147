"""The evaluation phase of the training loop: when to evaluate, on what, and how it is fanned out.

`Controller.evaluate` asks `Evaluation.due` between steps and then calls `Evaluation.run` (after
the weight sync, so every engine holds the version being evaluated). The eval prompts are split across the engines; each engine
generates and scores its share beside its training requests and returns small results to the
controller. Nothing goes to the buffer: eval samples never enter training or its accounting.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
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

    def run(
        self,
        engines: dict[int, ActorHandle],
        step: int,
        elapsed_s: float,
        replace: Callable[[list[int]], dict[int, ActorHandle]],
    ) -> EvalRecord:
        """Generate and score the eval set on `engines` (by engine id; every one holds policy version
        `step`). An engine that dies meanwhile (its actor, or its vLLM engine core) hands the prompts
        it has no result for to the engines still alive (`reassigned_prompts`); with none left,
        `replace(dead ids)` starts replacements holding the same version and returns the pool's
        engines. Dead engines not yet replaced are replaced once the evaluation is done. Every eval
        prompt is scored exactly once (or counted in `failed_prompts`)."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.cfg.timeout_s
        live = dict(engines)
        pending: dict[ray.ObjectRef, tuple[int, list[Prompt]]] = {}

        def dispatch(prompts: list[Prompt]) -> None:
            ids = sorted(live)
            for engine_id, share in zip(ids, split(prompts, len(ids)), strict=True):
                if share:
                    pending[self._dispatch(live[engine_id], share)] = (engine_id, share)

        dispatch(self.prompts)
        batches: list[EvalBatch] = []
        dead: list[int] = []  # died during this evaluation, not replaced yet
        moved = died = 0
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                raise RunError(f"evaluation at step {step} took longer than eval.timeout_s={self.cfg.timeout_s:.0f}s")
            engine_id, share = pending.pop(done[0])
            try:
                batch: EvalBatch | None = ray.get(done[0])
            except ray.exceptions.RayActorError:
                batch = None  # the actor died: whatever it scored died with it
            if batch is not None:
                batches.append(batch)
                if not batch.engine_died:
                    continue
            if live.pop(engine_id, None) is not None:
                dead.append(engine_id)
                died += 1
            scored = {r.prompt_id for r in batch.results} if batch is not None else set()
            lost = [p for p in share if p.prompt_id not in scored]
            moved += len(lost)
            if lost:
                if not live:  # nobody left to take them: replacements first
                    live, dead = dict(replace(dead)), []
                dispatch(lost)
        if dead:
            replace(dead)
        self.last_step = step
        record = make_record(batches, self.cfg.pass_threshold, step, elapsed_s, time.perf_counter() - t0)
        record.reassigned_prompts, record.dead_engines = moved, died
        self._check_coverage(batches, step)
        return record

    def _dispatch(self, engine: ActorHandle, prompts: list[Prompt]) -> ray.ObjectRef:
        """One engine's share (one method, so a test can strike in the middle of an evaluation)."""
        return engine.evaluate.remote(prompts, self.params)

    def _check_coverage(self, batches: list[EvalBatch], step: int) -> None:
        """Every eval prompt has at most one result, and every prompt without one was counted failed."""
        ids = [r.prompt_id for b in batches for r in b.results]
        failed = sum(b.failed_prompts for b in batches)
        if len(ids) != len(set(ids)) or len(ids) + failed != len(self.prompts):
            raise RunError(
                f"evaluation at step {step}: {len(ids)} results ({len(ids) - len(set(ids))} repeated) and "
                f"{failed} failed prompts for an eval set of {len(self.prompts)}"
            )
