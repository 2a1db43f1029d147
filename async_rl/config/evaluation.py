"""Evaluation during training."""

from __future__ import annotations

from typing import Annotated

from async_rl.config.base import _f, _Section


class EvalConfig(_Section):
    """Evaluation during training: the engines generate on held-out prompts, outside the training path."""

    enabled: Annotated[
        bool, _f("evaluate during training (RUN_DIR/eval.jsonl, console, wandb eval/*); samples never enter training")
    ] = False
    every: Annotated[
        int, _f("evaluate after every this many optimizer steps (0 = only at the start and the end)", ge=0)
    ] = 0
    at_start: Annotated[bool, _f("evaluate the starting weights before the first step (step 0, or the resumed step)")] = True
    at_end: Annotated[bool, _f("evaluate after the last step (the final weights are synced to the engines first)")] = True
    n: Annotated[int, _f("samples per eval prompt (pass@1 is the mean over them)", ge=1)] = 1
    temperature: Annotated[float, _f("eval sampling temperature (0 = greedy)", ge=0)] = 0.0
    max_tokens: Annotated[int, _f("maximum eval completion length in tokens (0 = generators.max_tokens)", ge=0)] = 0
    max_prompts: Annotated[
        int, _f("eval prompts used: the first this many of the eval set (data.eval_files, or without them "
                "data.eval_task_prompts of the task's held-out stream); 0 = all", ge=0)
    ] = 0
    pass_threshold: Annotated[float, _f("a sample passes (counts for pass@1) when its reward is at least this")] = 1.0
    timeout_s: Annotated[float, _f("an evaluation that takes longer than this stops the run", gt=0)] = 1800.0
