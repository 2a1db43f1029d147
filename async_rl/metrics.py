"""One typed record per step, written three ways: a console line, a JSONL file, and wandb."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, TextIO

import msgspec

from async_rl.config import WandbConfig


class StepRecord(msgspec.Struct, kw_only=True):
    step: int
    version: int  # learner policy version after this step
    elapsed_s: float
    reward_mean: float
    loss: float
    kl_behav: float
    logprob_abs_diff: float
    logprob_mismatch: float | None  # |vLLM - learner| on the same tokens, same version (after a sync)
    grad_norm: float
    clip_frac: float
    tis_frac: float
    samples_per_s: float
    tokens_per_s: float
    learner_wait_s: float
    learner_compute_s: float
    sync_s: float
    generator_version: int
    buffer_waiting_groups: int
    lag_max: int
    lag_mean: float
    leased: int
    in_flight: int
    waiting: int
    trained: int
    dropped_stale: int
    filtered: int
    lost: int
    accounting_balanced: bool
    rejected_frames: int
    reward_errors: int
    reward_timeouts: int
    lr: float = 0.0  # learning rate of this step (after warmup/decay)
    masked_frac: float = 0.0  # completion tokens masked out for an extreme importance ratio
    kl_ref: float = 0.0  # KL estimate to the frozen reference model
    value_loss: float = 0.0  # ppo: the critic's value loss
    filtered_groups: int = 0  # groups dropped by dynamic sampling while this step's batch was collected
    requeued: int = 0  # leases handed back to the prompt pool (engine drained or died), leased again
    num_engines: int = 0  # generator engines in the pool at the end of the step
    data_epoch: int = 0  # the prompt stream's position after the step: epoch ...
    data_index: int = 0  # ... and items of that epoch's order drawn (a task: prompts drawn)
    skipped_prompts: int = 0  # prompts or data rows that could not be used (bad rows, too long), so far


def console_line(r: StepRecord, total_steps: int) -> str:
    mismatch = f"{r.logprob_mismatch:.1e}" if r.logprob_mismatch is not None else "n/a"
    return (
        f"step {r.step + 1:>4}/{total_steps} | v{r.version:<4} | reward {r.reward_mean:6.3f} | "
        f"loss {r.loss:+.4f} | {r.samples_per_s:7.1f} samples/s | buffer {r.buffer_waiting_groups:>3} groups | "
        f"lag max {r.lag_max} mean {r.lag_mean:.2f} | mismatch {mismatch} | "
        f"trained {r.trained} stale {r.dropped_stale} filtered {r.filtered} lost {r.lost}"
        + (f" requeued {r.requeued}" if r.requeued else "")
    )


class MetricsSink:
    def __init__(
        self,
        run_dir: Path,
        wandb_cfg: WandbConfig,
        config: dict[str, Any],
        total_steps: int,
        stream: TextIO = sys.stdout,
    ) -> None:
        self.total_steps = total_steps
        self.stream = stream
        self._jsonl = open(run_dir / "metrics.jsonl", "ab")
        self._wandb = None
        if wandb_cfg.mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            self._wandb = wandb.init(
                project=wandb_cfg.project,
                mode=wandb_cfg.mode,
                dir=str(run_dir),
                name=run_dir.name,
                config=config,
            )

    def log(self, record: StepRecord) -> None:
        # One line per record, flushed: a crash never leaves a half-written line behind.
        self._jsonl.write(msgspec.json.encode(record) + b"\n")
        self._jsonl.flush()
        print(console_line(record, self.total_steps), file=self.stream, flush=True)
        if self._wandb is not None:
            data = {k: v for k, v in msgspec.structs.asdict(record).items() if v is not None}
            self._wandb.log(data, step=record.step)

    def close(self) -> None:
        self._jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
