"""The single controller: start the processes, run the training loop, sync weights, log.

Ray is the control plane only: it places and starts the buffer, the generator engines and the
learner ranks, and carries small calls between them. Trajectories move over ZMQ, weights over the
broadcast group.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import ray
from ray.actor import ActorHandle

from async_rl import storage, versions
from async_rl.buffer.actor import BufferStats
from async_rl.cluster.placement import PlacementPlan
from async_rl.cluster.resources import WorkerGroup
from async_rl.config import Config
from async_rl.config.spec import LearnerSpec
from async_rl.control import checkpoint
from async_rl.control.autoscale import ScaleSignal
from async_rl.control.metrics import EpisodeStats, LengthStats, MetricsSink, StepRecord
from async_rl.control.runtime import START_TIMEOUT_S, Runtime
from async_rl.control.start_retry import engine_starts
from async_rl.control.supervisor import LearnerRestarted, PromptsExhausted, Supervisor
from async_rl.errors import RunError
from async_rl.evaluation.phase import Evaluation, eval_prompts
from async_rl.generator.engine import EngineStats
from async_rl.generator.pool import GeneratorPool
from async_rl.learner.base import MoeMetrics, StepMetrics, checkpoint_model_dir
from async_rl.learner.driver import LearnerDriver
from async_rl.reward_models.calls import RewardModelCounts
from async_rl.teacher.meter import TeacherMeter, TeacherStep
from async_rl.weight_sync.checksum import ParamChecksum, ShardChecksum, engine_checksum


class RunSummary(msgspec.Struct):
    run_dir: str
    steps: int
    final_version: int
    first_rewards: list[float]
    last_rewards: list[float]
    buffer: BufferStats
    engines: list[EngineStats]


class Controller:
    """The training loop. Processes are owned by the Runtime; failures are handled by the Supervisor."""

    def __init__(
        self, cfg: Config, model_dir: Path, run_dir: Path, plan: PlacementPlan, resume_from: Path | None = None
    ) -> None:
        """`resume_from`: a checkpoint folder (RUN_DIR/checkpoints/step_N); learner and engines start
        from its weights and the run continues at step N with policy version N."""
        self.cfg = cfg
        self.resume_from = resume_from
        self.start_step = 0
        self.resumed_checksum: ParamChecksum | None = None  # learner weights right after a resume
        # The run's initial weights (the KL reference), recorded in every checkpoint: a resumed run keeps
        # its anchor instead of taking the checkpoint's weights as a new one at every resume.
        recorded = checkpoint.load_state(resume_from).initial_model_dir if resume_from is not None else ""
        self.initial_model_dir = Path(recorded) if recorded else model_dir
        # On resume every process loads the checkpoint's HF folder (vLLM serves it directly); with
        # learner.lora the checkpoint holds the adapter alone: everyone starts from the base weights and
        # the learner sends the checkpoint's adapter before the engines generate (see _resume).
        self.lora = cfg.learner.lora.enabled
        self.model_dir = model_dir if resume_from is None else (
            self.initial_model_dir if self.lora else checkpoint_model_dir(resume_from)
        )
        self.run_dir = run_dir
        self.run_id = uuid.uuid4().hex[:12]
        self.version = 0
        self._last_logged_step = -1  # the highest step logged (a step logged again after a recovery is marked)
        self.teacher_meter = TeacherMeter()  # teacher.model: per-step rates from the engines' counters
        self.runtime = Runtime(cfg, self.run_id, self.model_dir, run_dir, plan, self.initial_model_dir, LearnerDriver)
        self.engine_starts = engine_starts(cfg)  # the first start and every replacement: one bound, one count
        self.supervisor: Supervisor | None = None
        eval_set = eval_prompts(cfg, self.model_dir) if cfg.eval.enabled else []  # rendered once, here
        self.evaluation = Evaluation(cfg.eval, eval_set, cfg.generators.max_tokens, cfg.train.total_steps)

    # read-only views of the runtime's handles (tests and benchmarks reach the processes through them)
    @property
    def generators(self) -> GeneratorPool:
        return self.runtime.generators

    @property
    def buffer(self) -> ActorHandle:
        return self.runtime.buffer

    @property
    def learner(self) -> WorkerGroup:
        return self.runtime.learner

    # ---- the training loop -----------------------------------------------------------------------

    def run(self, metrics: MetricsSink, between_steps: Callable[[int], None] | None = None) -> RunSummary:
        """Train `train.total_steps` steps. `between_steps(step)` runs after each step's sync (tests
        and operators use it to change the generator pool while the run goes on)."""
        t_ready = time.perf_counter()
        self.start()
        rt = self.runtime
        runners = versions.record_model_runners(self.run_dir, rt.generators.model_runners())
        print(f"model runner: {runners}", file=metrics.stream, flush=True)
        sup = self.supervisor = Supervisor(rt, self.cfg, self.run_dir, self.run_id, metrics.stream, self.engine_starts)
        sup.start()  # every process watched from here on, whatever the loop does (death_watch.py)
        print(
            f"ready in {time.perf_counter() - t_ready:.0f}s: {len(rt.generators.engines)} engine(s), "
            f"{rt.learner.world_size} learner rank(s); training",
            file=metrics.stream,
            flush=True,
        )
        t_start = time.perf_counter()
        step = self.start_step
        try:
            self.evaluate(metrics, t_start, at_start=True)
        except LearnerRestarted as restart:  # a rank died before the first step
            step = self.version = restart.step
        rewards: list[float] = []  # one per step from start_step on
        while step < self.cfg.train.total_steps:
            try:
                rewards.append(self.train_one(step, metrics, t_start, between_steps))
            except PromptsExhausted as exc:
                print(f"data: {exc}", file=metrics.stream, flush=True)
                break
            except LearnerRestarted as restart:
                # The learner went back to a checkpoint: the steps from there on are trained (and logged) again.
                step = self.version = restart.step
                del rewards[max(0, step - self.start_step) :]
                continue
            step += 1
        sup.finish_refills(step - 1, self.version)  # replacements still starting join before the end
        if not rewards:
            raise RunError(
                f"nothing to train: the checkpoint holds step {self.start_step}, train.total_steps is "
                f"{self.cfg.train.total_steps}"
            )
        k = max(1, min(5, len(rewards) // 4))
        return RunSummary(
            run_dir=str(self.run_dir),
            steps=len(rewards),
            final_version=self.version,
            first_rewards=rewards[:k],
            last_rewards=rewards[-k:],
            buffer=rt.buffer_stats(),
            engines=rt.generators.stats(),
        )

    def train_one(
        self, step: int, metrics: MetricsSink, t_start: float, between_steps: Callable[[int], None] | None
    ) -> float:
        """One step: train, sync, log, checkpoint, evaluate, resize the pool. Returns its mean reward.
        A learner recovery anywhere in it raises LearnerRestarted (supervisor.py)."""
        rt, sup = self.runtime, self.supervisor
        t0 = time.perf_counter()
        if self.cfg.placement == "colocated":
            self.take_turns()
        per_rank: list[StepMetrics] = sup.train_step(step)  # watches for dead processes
        self.version = step + 1
        # deaths found since the step's last look (the watcher reports them at once, the loop
        # acts here and after each phase below: sync, checkpoint, evaluation); deterministic: a
        # replacement waits for the sync below, the others finish their version's prompts first
        sup.act_on_deaths(step, rt.generators_version if self.cfg.train.deterministic else self.version)
        sync_s, settle_s, mismatch = 0.0, 0.0, None
        if self.version % self.cfg.train.sync_every == 0 or sup.sync_owed:
            settle_s, sync_s = self.advance_engines(step)
            mismatch = self.logprob_mismatch()
        buffer: BufferStats = sup.on_buffer(step, rt.buffer_stats)
        elapsed = time.perf_counter() - t0
        record = make_record(step, self.version, per_rank, buffer, elapsed, sync_s, mismatch, t_start)
        record.settle_s = settle_s
        if sync_s:
            record.sync_bytes, record.sync_delta = rt.generators.last_sync.sent_bytes, rt.generators.last_sync.delta
        record.delta_fallbacks = rt.generators.delta_fallbacks
        record.num_engines = len(rt.generators.engines)
        record.recoveries = sup.recovery.recoveries
        record.failed_starts = sup.failed_starts
        record.replayed = step <= self._last_logged_step
        self._last_logged_step = max(self._last_logged_step, step)
        record.kl_teacher = per_rank[0].kl_teacher  # a global mean: the same on every rank
        record.teacher_missing = sum(m.teacher_missing for m in per_rank)
        if rt.reward_models is not None or self.cfg.env.name or rt.teacher is not None:
            engines = rt.generators.stats()
            add_rollout_counts(record, engines)
            if rt.reward_models is not None:
                add_reward_model_counts(record, engines, rt.reward_models.restarts)
            if rt.teacher is not None:
                add_teacher_counts(record, self.teacher_meter.step({e.engine_id: e.teacher for e in engines if e.teacher}, elapsed))
                record.teacher_restarts = rt.teacher.restarts
        metrics.log(record)
        sup.check_failures(buffer)  # a run whose rewards all fail stops here
        if self.checkpoint_due(step):
            self.save_checkpoint()
            sup.act_on_deaths(step, self.version)
        self.evaluate(metrics, t_start)
        sup.act_on_deaths(step, self.version)
        signal = ScaleSignal(elapsed, record.learner_wait_s, buffer.waiting_groups, self.cfg.train.prompts_per_step)
        sup.between_steps(step, signal)  # operator requests, autoscaling
        if between_steps is not None:
            between_steps(step)
        return record.reward_mean

    def evaluate(self, metrics: MetricsSink, t_start: float, at_start: bool = False) -> None:
        """The evaluation phase (evaluation/phase.py), when due: the engines generate and score the
        eval set with the current weights; the results are logged apart from training."""
        if not self.evaluation.due(self.version, at_start):
            return
        if self.runtime.generators_version != self.version:  # the last step's weights, not yet synced
            self.advance_engines(self.version - 1)
        engines = {eid: h.actor for eid, h in self.generators.engines.items()}
        sup, version = self.supervisor, self.version
        record = self.evaluation.run(
            engines, version, time.perf_counter() - t_start, lambda dead: sup.replace_dead(version, dead)
        )
        metrics.log_eval(record)
        self.supervisor.check_eval(record)

    def advance_engines(self, step: int) -> tuple[float, float]:
        """The learner's weights (version step + 1) into the engines. train.deterministic: first the
        engines finish the prompts of the version they hold (Supervisor.settle_generation). Returns
        the seconds of each: (settle, sync)."""
        settle_s = self.supervisor.settle_generation(step, self.version) if self.cfg.train.deterministic else 0.0
        return settle_s, self.supervisor.sync(self.version)

    def take_turns(self) -> None:
        """Colocated: once the batch is generated, the engines sleep and the learner gets the cores
        (on GPU, vLLM's memory too); the next weight sync wakes them."""
        if not ray.get(self.buffer.wait_for_batch.remote(START_TIMEOUT_S)):
            raise RunError(f"no full batch within {START_TIMEOUT_S:.0f}s: the generators produce nothing")
        self.generators.sleep()

    def logprob_mismatch(self) -> float | None:
        """Right after a sync both sides hold the same version: score the same tokens on each."""
        n = self.cfg.train.mismatch_probe_samples
        if n == 0:
            return None
        # collective; rank 0's probe
        probe = self.supervisor.on_learner(self.version - 1, [a.probe_logprobs.remote(n) for a in self.learner.actors])[0]
        for engine in self.generators.actors:
            try:
                return ray.get(engine.score.remote(probe), timeout=START_TIMEOUT_S)
            except ray.exceptions.RayError:
                continue  # it died since the sync: the supervisor replaces it at its next check
        return None

    def checksums(self) -> tuple[ParamChecksum, dict[int, ParamChecksum]]:
        """The learner's parameter checksum and every engine's (its TP workers' parts added up)."""
        self.learner.call(lambda a: a.gather_weights.remote())
        learner = ray.get(self.learner.actors[0].param_checksum.remote())
        return learner, engine_checksums(self.generators.checksums())

    # ---- checkpoints -------------------------------------------------------------------------------

    def checkpoint_due(self, step: int) -> bool:
        t = self.cfg.train
        last = step == t.total_steps - 1
        return (t.checkpoint_every > 0 and (step + 1) % t.checkpoint_every == 0) or (last and t.checkpoint_at_end)

    def save_checkpoint(self) -> Path:
        """RUN_DIR/checkpoints/step_N after N steps: learner state (every rank), buffer accounting and
        prompt position, policy version. Written aside and renamed into place."""
        if warning := checkpoint.space_warning(self.run_dir, self.version):
            print(warning, file=self.supervisor.stream, flush=True)
        tmp = checkpoint.begin(self.run_dir)
        try:
            # a rank dying in it is recovered (the written part stays in a .tmp- folder no resume reads)
            self.supervisor.on_learner(self.version - 1, [a.save_checkpoint.remote(str(tmp)) for a in self.learner.actors])
            state = checkpoint.RunCheckpoint(
                step=self.version,  # one optimizer step per version
                version=self.version,
                initial_model_dir=str(self.initial_model_dir),
                buffer=self.supervisor.on_buffer(self.version - 1, self.runtime.buffer_checkpoint_state),
                saved_at=time.time(),
            )
            final = checkpoint.commit(tmp, state, self.cfg.train.checkpoint_keep)
        except Exception as exc:
            if storage.out_of_space(exc):
                raise checkpoint.out_of_space(self.run_dir, tmp, self.version) from None
            why = storage.place_problem(self.run_dir)  # read-only, or gone: said as plainly as a full disk
            if why is None:
                raise
            raise checkpoint.unwritable(self.run_dir, tmp, self.version, why) from None
        checkpoint.discard_partial(self.run_dir, f"checkpoint {final.name}", self.supervisor.stream)  # cut short earlier
        return final

    def _resume(self) -> None:
        """Learner ranks restore the checkpoint; engines (started paused from its HF folder) must hold
        exactly the learner's weights before they generate as policy version N."""
        state = checkpoint.load_state(self.resume_from)
        steps = self.learner.call(lambda a: a.load_checkpoint.remote(str(self.resume_from)), timeout_s=START_TIMEOUT_S)
        if any(s != state.step for s in steps):
            raise RunError(f"checkpoint '{self.resume_from}': learner state is at step {steps[0]}, run state at {state.step}")
        if self.lora:
            # The adapter goes to the paused engines like any update (checked as served, see
            # GeneratorPool.sync), which resumes them as version N.
            if not self.runtime.sync_weights(state.version):
                raise RunError(f"resume: the learner is past version {state.version} before its first step")
            ray.get(self.buffer.set_generator_version.remote(state.version))
            self.start_step, self.version = state.step, state.version
            self.resumed_checksum = ray.get(self.learner.actors[0].param_checksum.remote())
            return
        learner_ck, engine_cks = self.checksums()
        for engine_id, ck in engine_cks.items():
            if not ck.close_to(learner_ck):
                raise RunError(f"resume: engine {engine_id} loaded other weights than the learner from '{self.model_dir}'")
        ray.get(self.buffer.set_generator_version.remote(state.version))
        ray.get([a.resume.remote(state.version) for a in self.generators.actors], timeout=START_TIMEOUT_S)
        self.start_step, self.version = state.step, state.version
        self.runtime.engines_hold(state.version)
        self.resumed_checksum = learner_ck

    # ---- the generator pool, while the run goes on ----------------------------------------------

    def add_engines(self, count: int) -> list[int]:
        """New engines start paused and receive the current weights at the next sync."""
        return self.supervisor.add_engines(count)

    def remove_engine(self, engine_id: int) -> int:
        """Drain and stop one engine; returns how many of its leases went back to the prompt pool."""
        return self.supervisor.remove_engine(engine_id)

    # ---- start and stop --------------------------------------------------------------------------

    def start(self) -> None:
        resuming = self.resume_from is not None
        # before any lease: accounting and prompt position go on; engines start paused (version 0 = the checkpoint)
        state = checkpoint.load_state(self.resume_from).buffer if resuming else None
        self.runtime.start(state, engines_paused=resuming, starts=self.engine_starts)
        if resuming:
            self._resume()

    def learner_spec(self, serve: str) -> LearnerSpec:
        """What every learner rank is started with; `serve`: the buffer's batch-serving address."""
        return self.runtime.learner_spec(serve)

    def shutdown(self) -> BufferStats | None:
        """Stop everything this controller started. Safe to call twice."""
        if self.supervisor is not None:
            self.supervisor.close()
            self.supervisor = None
        return self.runtime.shutdown()


def engine_checksums(parts: dict[int, list[ShardChecksum]]) -> dict[int, ParamChecksum]:
    """Each engine's whole-model checksum from its TP workers' parts (comparable with the learner's)."""
    out = {}
    for engine_id, workers in parts.items():
        try:
            out[engine_id] = engine_checksum(workers)
        except ValueError as exc:
            raise RunError(f"engine {engine_id}: {exc}") from None
    return out


def add_rollout_counts(record: StepRecord, engines: list[EngineStats]) -> None:
    """What the engines' rollouts counted so far (each kind through the rollout interface), summed
    over the engines that answer."""
    for e in engines:
        if e.rollout is None:
            continue
        record.rollout_episodes += e.rollout.episodes
        a = e.rollout.agents
        if a is not None:
            record.agent_calls += a.calls
            record.agent_prefix_breaks += a.prefix_breaks
            record.agent_segments += a.segments
            record.agent_errors += a.errors
            record.agent_timeouts += a.timeouts
            record.agent_crashes += a.crashes
            record.agent_refused += a.refused


def add_reward_model_counts(record: StepRecord, engines: list[EngineStats], restarts: int) -> None:
    """task.reward names a reward model: its calls so far by outcome, summed over the engines that answer."""
    total = RewardModelCounts()
    for e in engines:
        if e.reward_model is not None:
            total.add(e.reward_model)
    record.reward_model_calls = total.calls
    record.reward_model_unparseable = total.unparseable
    record.reward_model_failures = total.failures
    record.reward_model_timeouts = total.timeouts
    record.reward_model_restarts = restarts


def add_teacher_counts(record: StepRecord, t: TeacherStep) -> None:
    record.teacher_tokens = t.tokens
    record.teacher_tokens_per_s = t.tokens_per_s
    record.teacher_share = t.share
    record.teacher_unscored = t.unscored
    record.teacher_failures = t.failures
    record.teacher_timeouts = t.timeouts


def make_record(
    step: int,
    version: int,
    per_rank: list[StepMetrics],
    buffer: BufferStats,
    step_s: float,
    sync_s: float,
    mismatch: float | None,
    t_start: float,
) -> StepRecord:
    n = len(per_rank)
    samples = sum(m.samples for m in per_rank)
    tokens = sum(m.tokens for m in per_rank)
    a = buffer.accounts
    lengths = length_stats(per_rank)
    ep = episode_stats(per_rank)
    return StepRecord(
        step=step,
        version=version,
        elapsed_s=time.perf_counter() - t_start,
        reward_mean=sum(m.reward_mean for m in per_rank) / n,
        loss=sum(m.loss for m in per_rank) / n,
        kl_behav=sum(m.kl_behav for m in per_rank) / n,
        logprob_abs_diff=sum(m.logprob_abs_diff for m in per_rank) / n,
        logprob_mismatch=mismatch,
        grad_norm=per_rank[0].grad_norm,
        clip_frac=sum(m.clip_frac for m in per_rank) / n,
        tis_frac=sum(m.tis_frac for m in per_rank) / n,
        samples_per_s=samples / step_s,
        tokens_per_s=tokens / step_s,
        learner_wait_s=max(m.wait_s for m in per_rank),
        learner_compute_s=max(m.compute_s for m in per_rank),
        sync_s=sync_s,
        generator_version=buffer.generator_version,
        buffer_waiting_groups=buffer.waiting_groups,
        lag_max=buffer.last_batch_max_lag,
        lag_mean=buffer.last_batch_mean_lag,
        leased=a.leased,
        in_flight=a.in_flight,
        waiting=a.waiting,
        trained=a.trained,
        dropped_stale=a.dropped_stale,
        filtered=a.filtered,
        lost=a.lost,
        requeued=a.requeued,
        accounting_balanced=a.balanced(),
        rejected_frames=sum(buffer.rejected_frames.values()),
        reward_errors=buffer.reward_errors,
        reward_timeouts=buffer.reward_timeouts,
        reward_crashes=buffer.reward_crashes,
        reward_pool_restarts=buffer.reward_pool_restarts,
        lr=per_rank[0].lr,
        nonfinite_steps=per_rank[0].nonfinite_steps,  # every rank skips together
        masked_frac=sum(m.masked_frac for m in per_rank) / n,
        kl_ref=sum(m.kl_ref for m in per_rank) / n,
        value_loss=sum(m.value_loss for m in per_rank) / n,
        entropy=sum(m.entropy for m in per_rank) / n,
        cov_frac=sum(m.cov_frac for m in per_rank) / n,
        filtered_groups=buffer.last_batch_filtered_groups,
        data_epoch=buffer.data_position.epoch,
        data_index=buffer.data_position.index,
        skipped_prompts=sum(buffer.skipped_prompts.values()),
        completion_len_mean=lengths.mean,
        completion_len_p50=lengths.p50,
        completion_len_p90=lengths.p90,
        completion_len_max=lengths.max,
        truncation_rate=lengths.truncation_rate,
        turns_mean=ep.turns_mean,
        turns_max=ep.turns_max,
        tool_calls_per_episode=ep.tool_calls_per_episode,
        tool_errors_per_episode=ep.tool_errors_per_episode,
        tool_success=ep.tool_success,
        sandbox_timeouts=ep.sandbox_timeouts,
        env_token_share=ep.env_token_share,
        samples_across_updates=sum(m.across_updates for m in per_rank),
        **moe_fields(per_rank[0].moe),
    )


def moe_fields(m: MoeMetrics | None) -> dict:
    """StepRecord's MoE fields from the learner's (the same on every rank: reduced over the group)."""
    if m is None:
        return {}
    return {
        "moe_replay": m.replay, "router_agreement": m.router_agreement,
        "router_agreement_worst_layer": m.router_agreement_worst_layer, "router_worst_layer": m.worst_layer,
        "expert_load_max_mean": m.expert_load_max_mean, "moe_routed_tokens": m.routed_tokens,
        "moe_unrouted_tokens": m.unrouted_tokens, "moe_aux_loss": m.aux_loss,
        "moe_mismatch_replay": m.mismatch_replay, "moe_mismatch_live": m.mismatch_live,
    }


def episode_stats(per_rank: list[StepMetrics]) -> EpisodeStats:
    """Turns and tool use of the trained batch's multi-turn episodes (every rank's shard)."""
    eps = [e for m in per_rank for e in m.episodes]
    if not eps:
        return EpisodeStats()
    tokens = sum(n for m in per_rank for n in m.completion_lens)
    attempts = sum(e.tool_ok + e.tool_errors for e in eps)
    return EpisodeStats(
        turns_mean=sum(e.turns for e in eps) / len(eps),
        turns_max=max(e.turns for e in eps),
        tool_calls_per_episode=sum(e.tool_calls for e in eps) / len(eps),
        tool_errors_per_episode=sum(e.tool_errors for e in eps) / len(eps),
        tool_success=sum(e.tool_ok for e in eps) / attempts if attempts else 0.0,
        sandbox_timeouts=sum(e.tool_timeouts for e in eps),
        env_token_share=sum(m.env_tokens for m in per_rank) / max(1, tokens),
    )


def length_stats(per_rank: list[StepMetrics]) -> LengthStats:
    """Completion lengths and truncation of the whole trained batch (every rank's shard)."""
    lens = np.asarray([n for m in per_rank for n in m.completion_lens], dtype=np.float64)
    if not lens.size:
        return LengthStats()
    return LengthStats(
        mean=float(lens.mean()),
        p50=float(np.percentile(lens, 50)),
        p90=float(np.percentile(lens, 90)),
        max=int(lens.max()),
        truncation_rate=sum(m.truncated for m in per_rank) / lens.size,
    )
