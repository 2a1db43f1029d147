"""One typed record per step, written three ways: a console line, a JSONL file, and wandb."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import msgspec

from async_rl import storage
from async_rl.config import WandbConfig
from async_rl.errors import RunError
from async_rl.evaluation import scores
from async_rl.evaluation.scores import EvalRecord

EVAL_FILE = "eval.jsonl"


class LengthStats(msgspec.Struct, frozen=True):
    """Completion lengths (tokens) of one trained batch, and the fraction cut at max_tokens."""

    mean: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    max: int = 0
    truncation_rate: float = 0.0


class EpisodeStats(msgspec.Struct, frozen=True):
    """Multi-turn episodes of one trained batch (all 0 for single-turn samples). Episode lengths are
    the completion_len_* fields (an episode's completion holds its model and environment turns)."""

    turns_mean: float = 0.0
    turns_max: int = 0
    tool_calls_per_episode: float = 0.0
    tool_errors_per_episode: float = 0.0
    tool_success: float = 0.0  # tool calls that ran ok / every call attempt (malformed, unknown, failed too)
    sandbox_timeouts: int = 0  # tool calls killed at the sandbox's time limit
    env_token_share: float = 0.0  # completion tokens written by the environment / all completion tokens


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
    # the step's weight sync (weight_sync.delta): bytes over the channel, whether the engines resumed on a delta,
    # and the deltas so far whose served checksum disagreed (each followed by a full update)
    sync_bytes: int = 0
    sync_delta: bool = False
    delta_fallbacks: int = 0
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
    reward_crashes: int = 0  # samples whose reward worker process died mid-call
    reward_pool_restarts: int = 0  # engines' reward pools restarted (wedged: no call resolved; or broken), so far
    lr: float = 0.0  # learning rate of this step (after warmup/decay)
    nonfinite_steps: int = 0  # optimizer steps of this batch skipped for a non-finite loss or gradient norm
    masked_frac: float = 0.0  # completion tokens masked out for an extreme importance ratio
    kl_ref: float = 0.0  # KL estimate to the frozen reference model
    value_loss: float = 0.0  # ppo: the critic's value loss
    filtered_groups: int = 0  # groups dropped by dynamic sampling while this step's batch was collected
    requeued: int = 0  # leases handed back to the prompt pool (engine drained or died), leased again
    num_engines: int = 0  # generator engines in the pool at the end of the step
    entropy: float = 0.0  # mean per-token entropy of the policy over the trained completion tokens
    cov_frac: float = 0.0  # fraction of loss tokens clipped (clip_cov) or penalised (kl_cov) by algorithm.cov_control
    # completions of the trained batch: length in tokens, and the fraction cut at max_tokens
    completion_len_mean: float = 0.0
    completion_len_p50: float = 0.0
    completion_len_p90: float = 0.0
    completion_len_max: int = 0
    truncation_rate: float = 0.0
    # multi-turn episodes (env): see EpisodeStats
    turns_mean: float = 0.0
    turns_max: int = 0
    tool_calls_per_episode: float = 0.0
    tool_errors_per_episode: float = 0.0
    tool_success: float = 0.0
    sandbox_timeouts: int = 0
    env_token_share: float = 0.0
    samples_across_updates: int = 0  # trained samples whose tokens came from more than one policy version
    # Learner recoveries so far (train.recover); `replayed`: this step was logged before, and its training
    # was lost when a recovery went back to an older checkpoint (the later record is the one that counts)
    recoveries: int = 0
    replayed: bool = False
    # Engine starts that failed and were retried or given up on (generators.start_attempts), over the run.
    failed_starts: int = 0
    # train.deterministic: seconds the sync waited for the engines to finish the prompts of their version
    settle_s: float = 0.0
    data_epoch: int = 0  # the prompt stream's position after the step: epoch ...
    data_index: int = 0  # ... and items of that epoch's order drawn (a task: prompts drawn)
    skipped_prompts: int = 0  # prompts or data rows that could not be used (bad rows, too long), so far
    # task.reward=judge:/classifier: calls to the reward model so far (engines alive), by outcome, and its
    # replicas restarted after they died
    reward_model_calls: int = 0
    reward_model_unparseable: int = 0  # judge replies without a verdict (scored task.judge.unparseable_reward)
    reward_model_failures: int = 0  # error answers or no connection (reward errors)
    reward_model_timeouts: int = 0  # past the model's timeout_s (reward errors)
    reward_model_restarts: int = 0
    # env: what the engines' rollouts counted so far (engines alive): episodes run (environment or
    # agent, training and evaluation); agents: their model calls, prefix breaks (a call whose prompt
    # did not extend its episode's tokens), trained segments, and failed agents by kind
    rollout_episodes: int = 0
    agent_calls: int = 0
    agent_prefix_breaks: int = 0
    agent_segments: int = 0
    agent_errors: int = 0
    agent_timeouts: int = 0
    agent_crashes: int = 0
    agent_refused: int = 0  # endpoint requests without the engine's key
    # teacher.model (algorithm.name=opd): the batch's mean per-token reverse KL to the teacher (log pi_old -
    # log teacher over the scored model tokens), its samples without a teacher score; since the last step
    # (engines alive): completion tokens the teacher scored, per second of the step, and the share of
    # the scored groups' time (generation + rewards + teacher) spent waiting for the teacher; so far:
    # samples pushed unscored after teacher.max_wait_s, failed and timed-out calls (tried again), restarts
    kl_teacher: float = 0.0
    teacher_missing: int = 0
    teacher_tokens: int = 0
    teacher_tokens_per_s: float = 0.0
    teacher_share: float = 0.0
    teacher_unscored: int = 0
    teacher_failures: int = 0
    teacher_timeouts: int = 0
    teacher_restarts: int = 0
    # MoE models (torch learner; None for a dense model): learner/base.py MoeMetrics, over the learner group
    moe_replay: bool | None = None  # learner.routing_replay as it ran
    router_agreement: float | None = None  # routed tokens whose live top-k set is the engine's in every MoE layer
    router_agreement_worst_layer: float | None = None  # the lowest per-layer agreement ...
    router_worst_layer: int | None = None  # ... in this MoE layer
    expert_load_max_mean: float | None = None  # busiest expert's tokens / the mean per expert, worst layer
    moe_routed_tokens: int | None = None  # tokens with an engine route (replayed when replay is on)
    moe_unrouted_tokens: int | None = None  # tokens without one: the live router took them
    moe_aux_loss: float | None = None  # the load-balancing loss (learner.moe_aux_loss_coef > 0)
    moe_mismatch_replay: float | None = None  # |learner - engine| log-prob on the probe, replay on
    moe_mismatch_live: float | None = None  # the same with the live router


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def moe_part(r: StepRecord) -> str:
    """The console line's MoE part: routing agreement, expert load, unrouted tokens, the probe's mismatch."""
    return (
        f" | moe replay {'on' if r.moe_replay else 'off'} agree {_num(r.router_agreement, '.1%')} worst "
        f"{_num(r.router_agreement_worst_layer, '.1%')} (layer {r.router_worst_layer}) load max/mean "
        f"{_num(r.expert_load_max_mean, '.2f')} unrouted {r.moe_unrouted_tokens} | mismatch replay "
        f"{_num(r.moe_mismatch_replay, '.1e')} live {_num(r.moe_mismatch_live, '.1e')}"
    )


def console_line(r: StepRecord, total_steps: int) -> str:
    mismatch = f"{r.logprob_mismatch:.1e}" if r.logprob_mismatch is not None else "n/a"
    return (
        f"step {r.step + 1:>4}/{total_steps} | v{r.version:<4} | reward {r.reward_mean:6.3f} | "
        f"loss {r.loss:+.4f} | entropy {r.entropy:.3f} | {r.samples_per_s:7.1f} samples/s | buffer {r.buffer_waiting_groups:>3} groups | "
        f"lag max {r.lag_max} mean {r.lag_mean:.2f} | mismatch {mismatch} | "
        f"len {r.completion_len_mean:.0f} p90 {r.completion_len_p90:.0f} max {r.completion_len_max} "
        f"trunc {r.truncation_rate:.0%} | "
        f"trained {r.trained} stale {r.dropped_stale} filtered {r.filtered} lost {r.lost}"
        + (f" requeued {r.requeued}" if r.requeued else "")
        + (f" | nonfinite {r.nonfinite_steps} step(s) skipped" if r.nonfinite_steps else "")
        + (
            f" | turns {r.turns_mean:.1f} max {r.turns_max} tools {r.tool_calls_per_episode:.2f} "
            f"err {r.tool_errors_per_episode:.2f} ok {r.tool_success:.0%} env {r.env_token_share:.0%}"
            if r.turns_max
            else ""
        )
        + (moe_part(r) if r.moe_replay is not None else "")
        + (
            f" | agent calls {r.agent_calls} prefix breaks {r.agent_prefix_breaks} failed "
            f"{r.agent_errors}/{r.agent_timeouts}/{r.agent_crashes} (error/timeout/crash)"
            if r.agent_calls or r.agent_errors or r.agent_timeouts or r.agent_crashes
            else ""
        )
        + (
            f" | teacher KL {r.kl_teacher:.3f} {r.teacher_tokens_per_s:.0f} tok/s share {r.teacher_share:.0%}"
            + (f" unscored {r.teacher_unscored}" if r.teacher_unscored else "")
            if r.teacher_tokens or r.teacher_unscored or r.kl_teacher
            else ""
        )
    )


def _append(fh: BinaryIO, line: bytes, what: str) -> None:
    """One record, flushed; a full disk stops the run with one line (bytes needed and free)."""
    try:
        fh.write(line)
        fh.flush()
    except OSError as exc:
        if storage.out_of_space(exc):
            raise RunError(storage.space_line(what, Path(fh.name), len(line))) from None
        why = storage.place_problem(Path(fh.name).parent)
        if why is None:
            raise
        raise RunError(f"{what}: writing {fh.name} failed: its folder {why}") from None


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
        self._eval_path = run_dir / EVAL_FILE  # opened at the first evaluation
        self._eval_jsonl = None
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
        _append(self._jsonl, msgspec.json.encode(record) + b"\n", f"metrics step {record.step}")
        print(console_line(record, self.total_steps), file=self.stream, flush=True)
        if self._wandb is not None:
            data = {k: v for k, v in msgspec.structs.asdict(record).items() if v is not None}
            self._wandb.log(data, step=record.step)

    def log_eval(self, record: EvalRecord) -> None:
        """Evaluations go to their own file (RUN_DIR/eval.jsonl): metrics.jsonl stays one record per
        training step. In wandb they share the step axis (optimizer steps done) under eval/."""
        if self._eval_jsonl is None:
            self._eval_jsonl = open(self._eval_path, "ab")
        _append(self._eval_jsonl, msgspec.json.encode(record) + b"\n", f"evaluation at step {record.step}")
        print(scores.console_line(record), file=self.stream, flush=True)
        if self._wandb is not None:
            self._wandb.log(scores.flat_metrics(record), step=record.step)

    def close(self) -> None:
        self._jsonl.close()
        if self._eval_jsonl is not None:
            self._eval_jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
