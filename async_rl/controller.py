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
from typing import Any

import msgspec
import ray
from ray.actor import ActorHandle

from async_rl import settings
from async_rl.buffer.actor import BufferStats, ReplayBuffer
from async_rl.cluster.placement import PlacementPlan
from async_rl.cluster.resources import ResourcePool, WorkerGroup
from async_rl.config import Config
from async_rl.errors import RunError
from async_rl.generator.engine import EngineStats
from async_rl.generator.pool import GeneratorPool
from async_rl.learner.base import StepMetrics
from async_rl.learner.torch_learner import TorchLearnerRank
from async_rl.metrics import MetricsSink, StepRecord
from async_rl.security import RunKeys, make_run_keys, warn_insecure
from async_rl.weight_sync.checksum import ParamChecksum

START_TIMEOUT_S = 600.0


class RunSummary(msgspec.Struct):
    run_dir: str
    steps: int
    final_version: int
    first_rewards: list[float]
    last_rewards: list[float]
    buffer: BufferStats
    engines: list[EngineStats]


class Controller:
    def __init__(self, cfg: Config, model_dir: Path, run_dir: Path, plan: PlacementPlan) -> None:
        self.cfg = cfg
        self.model_dir = model_dir
        self.run_dir = run_dir
        self.plan = plan
        self.run_id = uuid.uuid4().hex[:12]
        self.version = 0
        self.buffer: ActorHandle | None = None
        self.generators: GeneratorPool | None = None
        self.learner: WorkerGroup | None = None
        self._pools: list[ResourcePool] = []
        self.keys: RunKeys | None = None  # this run's data-plane CURVE keys (made at start)

    # ---- the training loop -----------------------------------------------------------------------

    def run(self, metrics: MetricsSink, between_steps: Callable[[int], None] | None = None) -> RunSummary:
        """Train `train.total_steps` steps. `between_steps(step)` runs after each step's sync (tests
        and operators use it to change the generator pool while the run goes on)."""
        t_ready = time.perf_counter()
        self.start()
        print(
            f"ready in {time.perf_counter() - t_ready:.0f}s: {len(self.generators.engines)} engine(s), "
            f"{self.learner.world_size} learner rank(s); training",
            file=metrics.stream,
            flush=True,
        )
        t_start = time.perf_counter()
        rewards: list[float] = []
        for step in range(self.cfg.train.total_steps):
            t0 = time.perf_counter()
            if self.cfg.placement == "colocated":
                self.take_turns()
            per_rank: list[StepMetrics] = self.learner.call(lambda a, s=step: a.train_step.remote(s))
            self.version = step + 1
            sync_s, mismatch = 0.0, None
            if self.version % self.cfg.train.sync_every == 0:
                sync_s = self.sync_weights(self.version)
                mismatch = self.logprob_mismatch()
            buffer: BufferStats = ray.get(self.buffer.stats.remote())
            elapsed = time.perf_counter() - t0
            record = make_record(step, self.version, per_rank, buffer, elapsed, sync_s, mismatch, t_start)
            metrics.log(record)
            rewards.append(record.reward_mean)
            if between_steps is not None:
                between_steps(step)
        k = max(1, min(5, len(rewards) // 4))
        return RunSummary(
            run_dir=str(self.run_dir),
            steps=len(rewards),
            final_version=self.version,
            first_rewards=rewards[:k],
            last_rewards=rewards[-k:],
            buffer=ray.get(self.buffer.stats.remote()),
            engines=self.generators.stats(),
        )

    def take_turns(self) -> None:
        """Colocated: once the batch is generated, the engines sleep and the learner gets the cores
        (on GPU, vLLM's memory too); the next weight sync wakes them."""
        if not ray.get(self.buffer.wait_for_batch.remote(START_TIMEOUT_S)):
            raise RunError(f"no full batch within {START_TIMEOUT_S:.0f}s: the generators produce nothing")
        self.generators.sleep()

    def sync_weights(self, version: int) -> float:
        """Weights of `version` from learner rank 0 into every engine; then admission may use them."""
        seconds = self.generators.sync(self.learner.actors[0], version)
        ray.get(self.buffer.set_generator_version.remote(version))
        return seconds

    def logprob_mismatch(self) -> float | None:
        """Right after a sync both sides hold the same version: score the same tokens on each."""
        n = self.cfg.train.mismatch_probe_samples
        if n == 0:
            return None
        probe = ray.get(self.learner.actors[0].probe_logprobs.remote(n))
        return ray.get(self.generators.actors[0].score.remote(probe), timeout=START_TIMEOUT_S)

    def checksums(self) -> tuple[ParamChecksum, dict[int, list[ParamChecksum]]]:
        """The learner's parameter checksum and every generator worker's, by engine id."""
        learner = ray.get(self.learner.actors[0].param_checksum.remote())
        return learner, self.generators.checksums()

    # ---- the generator pool, while the run goes on ----------------------------------------------

    def add_engines(self, count: int) -> list[int]:
        """New engines start paused and receive the current weights at the next sync."""
        return self.generators.add(count, paused=True)

    def remove_engine(self, engine_id: int) -> int:
        return self.generators.remove(engine_id)

    # ---- start and stop --------------------------------------------------------------------------

    def start(self) -> None:
        cfg = self.cfg
        if cfg.security.curve:
            self.keys = make_run_keys()
        else:
            warn_insecure()
        keys = self.keys
        self.buffer = ray.remote(ReplayBuffer).options(num_cpus=0, name=f"buffer-{self.run_id}").remote(
            settings.buffer_settings(cfg, self.run_id, keys)
        )
        addresses = ray.get(self.buffer.start.remote(), timeout=START_TIMEOUT_S)
        self.generators = GeneratorPool(
            lambda i: settings.engine_settings(cfg, self.run_id, self.model_dir, self.plan, i, addresses.ingest, keys),
            self.buffer,
            cfg.generators.cpus_per_engine,
            cfg.generators.tensor_parallel_size,
            cfg.weight_sync.timeout_s,
        )
        learner_pool = ResourcePool("learner", [{"CPU": cfg.learner.cpus_per_rank}] * cfg.learner.world_size)
        self._pools.append(learner_pool)
        learner_settings = settings.learner_settings(cfg, self.run_id, self.model_dir, addresses.serve, keys)
        world, ranks = cfg.learner.world_size, self.plan.learner_ranks

        def make(rank: int, options: dict[str, Any], master: str) -> ActorHandle:
            return ray.remote(TorchLearnerRank).options(**options).remote(
                learner_settings, rank, world, master, ranks[rank].cores
            )

        self.learner = WorkerGroup(learner_pool, make, lambda a: ray.get(a.rendezvous_address.remote()))
        setup = [a.setup.remote() for a in self.learner.actors]  # overlaps vLLM's ~30 s start-up
        self.generators.add(cfg.generators.num_engines, paused=False)  # version 0 = the checkpoint
        ray.get(setup, timeout=START_TIMEOUT_S)
        self.generators.rebuild_membership(self.learner.actors[0])

    def shutdown(self) -> BufferStats | None:
        """Stop everything this controller started, through its handles. Safe to call twice."""
        final = None
        if self.generators is not None:
            self.generators.shutdown()
        if self.buffer is not None:
            try:
                final = ray.get(self.buffer.close.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(self.buffer, no_restart=True)
        if self.learner is not None:
            try:
                self.learner.call(lambda a: a.shutdown.remote(), timeout_s=30)
            except Exception:
                pass  # a dead or wedged rank is killed below all the same
            self.learner.kill()
        for pool in self._pools:
            pool.remove()
        self.generators, self.buffer, self.learner, self._pools = None, None, None, []
        return final


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
        accounting_balanced=a.balanced(),
        rejected_frames=sum(buffer.rejected_frames.values()),
        reward_errors=buffer.reward_errors,
        reward_timeouts=buffer.reward_timeouts,
    )
