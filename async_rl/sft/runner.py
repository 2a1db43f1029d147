"""A train.mode=sft run: the learner's ranks alone (no buffer, no engines, no weight sync), each
reading the demonstrations itself, one optimizer step per `sft.batch_size` conversations, the
held-out loss evaluated during training, checkpoints in the RL layout (RUN_DIR/checkpoints/step_N:
its model/ folder is what an RL run takes as model.path, no conversion), and `--resume` from one.

    RUN_DIR/metrics.jsonl   one SftRecord per step
    RUN_DIR/eval.jsonl      one SftEvalRecord per evaluation (the step it ran after)"""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path
from typing import TextIO

import msgspec
import ray

from async_rl.buffer.actor import BufferState
from async_rl.buffer.ledger import Accounts
from async_rl.cluster.placement import PlacementPlan
from async_rl.config import Config
from async_rl.control import checkpoint
from async_rl.control.metrics import EVAL_FILE
from async_rl.control.runtime import START_TIMEOUT_S, Runtime
from async_rl.errors import RunError
from async_rl.learner.base import checkpoint_model_dir
from async_rl.sft.learner import SftEval, SftLearner

STEP_TIMEOUT_S = 3600.0


class SftRecord(msgspec.Struct, kw_only=True):
    step: int
    loss: float  # the NLL per assistant token of the step's conversations, before the update
    grad_norm: float
    lr: float
    tokens: int  # assistant and other completion tokens trained on
    tokens_per_s: float
    epoch: float  # conversations drawn so far / conversations in the files
    elapsed_s: float


class SftEvalRecord(msgspec.Struct, kw_only=True):
    step: int  # optimizer steps done when it ran
    eval_loss: float  # NLL per assistant token of sft.eval_files
    eval_tokens: int


class SftSummary(msgspec.Struct):
    steps: int
    first_loss: float
    last_loss: float
    eval_loss: float | None


def _write(path: Path, record: msgspec.Struct) -> None:
    with open(path, "ab") as f:
        f.write(msgspec.json.encode(record) + b"\n")


class SftRun:
    def __init__(self, cfg: Config, model_dir: Path, run_dir: Path, plan: PlacementPlan, resume_from: Path | None = None):
        """`resume_from`: a checkpoint of this SFT run (RUN_DIR/checkpoints/step_N)."""
        self.cfg = cfg
        self.run_dir = run_dir
        self.resume_from = resume_from
        start_dir = checkpoint_model_dir(resume_from) if resume_from is not None else model_dir
        self.initial_model_dir = model_dir
        self.runtime = Runtime(cfg, uuid.uuid4().hex[:12], start_dir, run_dir, plan, model_dir, SftLearner)

    def run(self, stream: TextIO = sys.stdout) -> SftSummary:
        cfg = self.cfg
        group = self.runtime.start_learner_alone()
        start = 0
        if self.resume_from is not None:
            state = checkpoint.load_state(self.resume_from)
            steps = group.call(lambda a: a.load_checkpoint.remote(str(self.resume_from)), timeout_s=START_TIMEOUT_S)
            if any(s != state.step for s in steps):
                raise RunError(f"checkpoint '{self.resume_from}': learner state at step {steps[0]}, run state at {state.step}")
            start = state.step
        n, cut, skipped, n_eval = ray.get(group.actors[0].data_summary.remote())
        print(f"sft: {n} conversations ({cut} cut at the length limit, left out {skipped or 'none'}), {n_eval} held out; "
              f"{cfg.sft.batch_size} per step, {cfg.train.total_steps} steps", file=stream, flush=True)
        eval_loss = self.evaluate(start, stream) if start == 0 else None
        losses: list[float] = []
        t0 = time.perf_counter()
        for step in range(start, cfg.train.total_steps):
            t = time.perf_counter()
            per_rank = group.call(lambda a, step=step: a.sft_step.remote(step), timeout_s=STEP_TIMEOUT_S)
            step_s = time.perf_counter() - t
            tokens = sum(m.tokens for m in per_rank)
            record = SftRecord(
                step=step, loss=sum(m.loss for m in per_rank) / len(per_rank), grad_norm=per_rank[0].grad_norm,
                lr=per_rank[0].lr, tokens=tokens, tokens_per_s=tokens / step_s, epoch=(step + 1) * cfg.sft.batch_size / n,
                elapsed_s=time.perf_counter() - t0,
            )
            losses.append(record.loss)
            _write(self.run_dir / "metrics.jsonl", record)
            print(f"sft step {step + 1:>4}/{cfg.train.total_steps} | loss {record.loss:.4f} | grad {record.grad_norm:.3f} | "
                  f"lr {record.lr:.2e} | {record.tokens_per_s:6.0f} tokens/s | epoch {record.epoch:.2f}", file=stream, flush=True)
            done = step + 1
            if (cfg.train.checkpoint_every and done % cfg.train.checkpoint_every == 0) or (
                done == cfg.train.total_steps and cfg.train.checkpoint_at_end
            ):
                print(f"checkpoint: {self.save_checkpoint(done)}", file=stream, flush=True)
            if done == cfg.train.total_steps or (cfg.sft.eval_every and done % cfg.sft.eval_every == 0):
                eval_loss = self.evaluate(done, stream)
        return SftSummary(cfg.train.total_steps - start, losses[0] if losses else 0.0, losses[-1] if losses else 0.0, eval_loss)

    def evaluate(self, step: int, stream: TextIO) -> float | None:
        """The held-out NLL per assistant token (None without sft.eval_files), logged to eval.jsonl."""
        if not self.cfg.sft.eval_files:
            return None
        parts: list[SftEval] = self.runtime.learner.call(lambda a: a.sft_eval.remote(), timeout_s=STEP_TIMEOUT_S)
        tokens = sum(p.tokens for p in parts)
        record = SftEvalRecord(step=step, eval_loss=sum(p.nll_sum for p in parts) / max(tokens, 1), eval_tokens=tokens)
        _write(self.run_dir / EVAL_FILE, record)
        print(f"sft eval after step {step}: loss {record.eval_loss:.4f} over {tokens} assistant tokens", file=stream, flush=True)
        return record.eval_loss

    def save_checkpoint(self, step: int) -> Path:
        """RUN_DIR/checkpoints/step_N in the RL layout (its model/ folder is an HF model)."""
        tmp = checkpoint.begin(self.run_dir)
        self.runtime.learner.call(lambda a: a.save_checkpoint.remote(str(tmp)), timeout_s=STEP_TIMEOUT_S)
        empty = BufferState(accounts=Accounts(), generator_version=step, prompts_drawn=0, rejected_frames={},
                            reward_errors=0, reward_timeouts=0)
        state = checkpoint.RunCheckpoint(step=step, version=step, buffer=empty, saved_at=time.time(),
                                         initial_model_dir=str(self.initial_model_dir))
        return checkpoint.commit(tmp, state, self.cfg.train.checkpoint_keep)

    def shutdown(self) -> None:
        self.runtime.shutdown()
