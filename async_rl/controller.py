"""The single controller: start the processes, run the training loop, sync weights, log.

Ray is the control plane only: it places and starts the buffer, the generator engines and the
learner ranks, and carries small calls between them. Trajectories move over ZMQ, weights over the
broadcast group.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import ray
from ray.actor import ActorHandle

from async_rl.buffer.actor import BufferAddresses, BufferSettings, BufferStats, ReplayBuffer
from async_rl.cluster.placement import PlacementPlan
from async_rl.cluster.resources import ResourcePool, WorkerGroup
from async_rl.config import Config
from async_rl.errors import RunError
from async_rl.generator import vllm_compat as vc
from async_rl.generator.engine import EngineSettings, EngineStats, GeneratorEngine
from async_rl.learner.base import LearnerSettings, StepMetrics
from async_rl.learner.torch_learner import TorchLearnerRank
from async_rl.metrics import MetricsSink, StepRecord
from async_rl.weight_sync.base import UpdateReceipt
from async_rl.weight_sync.checksum import ParamChecksum

START_TIMEOUT_S = 600.0
SYNC_TIMEOUT_S = 600.0


class RunSummary(msgspec.Struct):
    run_dir: str
    steps: int
    final_version: int
    first_rewards: list[float]
    last_rewards: list[float]
    buffer: BufferStats
    engines: list[EngineStats]


@dataclass
class Processes:
    buffer: ActorHandle
    addresses: BufferAddresses
    engines: list[ActorHandle]
    engine_pool: ResourcePool
    learner: WorkerGroup
    workers_per_engine: int


class Controller:
    def __init__(self, cfg: Config, model_dir: Path, run_dir: Path, plan: PlacementPlan) -> None:
        self.cfg = cfg
        self.model_dir = model_dir
        self.run_dir = run_dir
        self.plan = plan
        self.run_id = uuid.uuid4().hex[:12]
        self.p: Processes | None = None
        self.version = 0

    # ---- the training loop -----------------------------------------------------------------------

    def run(self, metrics: MetricsSink) -> RunSummary:
        t_ready = time.perf_counter()
        self.p = self.start()
        print(
            f"ready in {time.perf_counter() - t_ready:.0f}s: {len(self.p.engines)} engine(s), "
            f"{self.p.learner.world_size} learner rank(s); training",
            file=metrics.stream,
            flush=True,
        )
        t_start = time.perf_counter()
        rewards: list[float] = []
        for step in range(self.cfg.train.total_steps):
            t0 = time.perf_counter()
            per_rank: list[StepMetrics] = self.p.learner.call(lambda a, s=step: a.train_step.remote(s))
            self.version = step + 1
            sync_s, mismatch = 0.0, None
            if self.version % self.cfg.train.sync_every == 0:
                sync_s = self.sync_weights(self.version)
                mismatch = self.logprob_mismatch()
            buffer: BufferStats = ray.get(self.p.buffer.stats.remote())
            elapsed = time.perf_counter() - t0
            record = make_record(step, self.version, per_rank, buffer, elapsed, sync_s, mismatch, t_start)
            metrics.log(record)
            rewards.append(record.reward_mean)
        k = max(1, min(5, len(rewards) // 4))
        return RunSummary(
            run_dir=str(self.run_dir),
            steps=len(rewards),
            final_version=self.version,
            first_rewards=rewards[:k],
            last_rewards=rewards[-k:],
            buffer=ray.get(self.p.buffer.stats.remote()),
            engines=ray.get([e.stats.remote() for e in self.p.engines]),
        )

    def sync_weights(self, version: int) -> float:
        """Pause engines (requests kept), broadcast from learner rank 0, verify, set version, resume."""
        p = self.p
        t0 = time.perf_counter()
        ray.get([e.pause.remote() for e in p.engines], timeout=SYNC_TIMEOUT_S)
        sent = p.learner.actors[0].broadcast_weights.remote(version)
        received = [e.receive_weights.remote(version) for e in p.engines]
        sender: UpdateReceipt = ray.get(sent, timeout=SYNC_TIMEOUT_S)
        for engine_id, receipts in enumerate(ray.get(received, timeout=SYNC_TIMEOUT_S)):
            for r in receipts:
                if (r.checksum, r.manifest_digest) != (sender.checksum, sender.manifest_digest):
                    # Engines stay paused: they never serve weights that failed verification.
                    raise RunError(f"weight update v{version}: engine {engine_id} received a corrupt update")
        ray.get([e.resume.remote(version) for e in p.engines], timeout=SYNC_TIMEOUT_S)
        ray.get(p.buffer.set_generator_version.remote(version))
        return time.perf_counter() - t0

    def logprob_mismatch(self) -> float | None:
        """Right after a sync both sides hold the same version: score the same tokens on each."""
        n = self.cfg.train.mismatch_probe_samples
        if n == 0:
            return None
        probe = ray.get(self.p.learner.actors[0].probe_logprobs.remote(n))
        return ray.get(self.p.engines[0].score.remote(probe), timeout=SYNC_TIMEOUT_S)

    def checksums(self) -> tuple[ParamChecksum, list[list[ParamChecksum]]]:
        """The learner's parameter checksum and every generator worker's (for tests and checks)."""
        learner = ray.get(self.p.learner.actors[0].param_checksum.remote())
        return learner, ray.get([e.param_checksums.remote() for e in self.p.engines])

    # ---- start and stop --------------------------------------------------------------------------

    def start(self) -> Processes:
        cfg = self.cfg
        buffer = ray.remote(ReplayBuffer).options(num_cpus=0, name=f"buffer-{self.run_id}").remote(
            BufferSettings(
                run_id=self.run_id,
                host=cfg.buffer.host,
                ingest_port=cfg.buffer.ingest_port,
                serve_port=cfg.buffer.serve_port,
                max_lag=cfg.train.max_lag,
                prompts_per_step=cfg.train.prompts_per_step,
                group_size=cfg.generators.group_size,
                filter_uniform_groups=cfg.buffer.filter_uniform_groups,
                max_frame_bytes=cfg.buffer.max_frame_mb << 20,
                task_name=cfg.task.name,
                task_seed=cfg.task.seed,
            )
        )
        self._buffer = buffer
        addresses: BufferAddresses = ray.get(buffer.start.remote(), timeout=START_TIMEOUT_S)

        g = cfg.generators
        engine_pool = ResourcePool("generators", [{"CPU": g.cpus_per_engine}] * g.num_engines, strategy="SPREAD")
        self._pools = [engine_pool]
        engines = [
            ray.remote(GeneratorEngine)
            .options(**engine_pool.actor_options(i), max_concurrency=1000)
            .remote(self.engine_settings(i, addresses.ingest), buffer)
            for i in range(g.num_engines)
        ]
        self._engines = engines
        engines_started = [e.start.remote() for e in engines]  # vLLM start takes ~30 s: overlap it

        learner_pool = ResourcePool("learner", [{"CPU": cfg.learner.cpus_per_rank}] * cfg.learner.world_size)
        self._pools.append(learner_pool)
        settings = self.learner_settings(addresses.serve)
        world = cfg.learner.world_size
        ranks = self.plan.learner_ranks

        def make(rank: int, options: dict[str, Any], master: str) -> ActorHandle:
            return ray.remote(TorchLearnerRank).options(**options).remote(settings, rank, world, master, ranks[rank].cores)

        learner = WorkerGroup(learner_pool, make, lambda a: ray.get(a.rendezvous_address.remote()))
        self._learner = learner
        learner.call(lambda a: a.setup.remote(), timeout_s=START_TIMEOUT_S)
        ray.get(engines_started, timeout=START_TIMEOUT_S)

        # The broadcast group: learner rank 0 + every worker of every engine.
        tp = g.tensor_parallel_size
        rank0 = learner.actors[0]
        info = ray.get(rank0.open_weight_group.remote(1 + len(engines) * tp))
        manifest = ray.get(rank0.weight_manifest.remote())
        joins = [e.join_weight_group.remote(info, 1 + i * tp, manifest) for i, e in enumerate(engines)]
        ray.get([rank0.join_weight_group.remote(), *joins], timeout=self.cfg.weight_sync.timeout_s)
        return Processes(buffer, addresses, engines, engine_pool, learner, tp)

    def engine_settings(self, engine_id: int, ingest: str) -> EngineSettings:
        cfg, g = self.cfg, self.cfg.generators
        return EngineSettings(
            engine_id=engine_id,
            run_id=self.run_id,
            spec=vc.EngineSpec(
                model_dir=str(self.model_dir),
                dtype=cfg.model.dtype,
                tensor_parallel_size=g.tensor_parallel_size,
                max_model_len=g.max_model_len,
                gpu_memory_utilization=g.gpu_memory_utilization,
                seed=g.seed + engine_id,
                max_num_seqs=g.max_inflight_prompts * g.group_size,
            ),
            cores=self.plan.engines[engine_id].cores,
            kv_cache_gib=g.kv_cache_gib,
            group_size=g.group_size,
            max_tokens=g.max_tokens,
            temperature=g.temperature,
            max_inflight_prompts=g.max_inflight_prompts,
            pause_mode=g.pause_mode,
            task_name=cfg.task.name,
            reward_timeout_s=cfg.task.reward_timeout_s,
            reward_workers=cfg.task.reward_workers,
            ingest_address=ingest,
        )

    def learner_settings(self, serve: str) -> LearnerSettings:
        cfg, lc, ws = self.cfg, self.cfg.learner, self.cfg.weight_sync
        return LearnerSettings(
            model_dir=str(self.model_dir),
            dtype=cfg.model.dtype,
            lr=lc.lr,
            weight_decay=lc.weight_decay,
            max_grad_norm=lc.max_grad_norm,
            clip_eps_low=lc.clip_eps_low,
            clip_eps_high=lc.clip_eps_high,
            tis_cap=lc.tis_cap,
            temperature=cfg.generators.temperature,
            seed=cfg.train.seed,
            run_id=self.run_id,
            buffer_address=serve,
            batch_timeout_s=START_TIMEOUT_S,
            bucket_mb=ws.bucket_mb,
            weight_sync_host=ws.host,
            weight_sync_port=ws.port,
            weight_sync_timeout_s=ws.timeout_s,
            weight_sync_backend=resolve_backend(cfg),
            weight_checksum=ws.checksum,
            wire_dtype=ws.wire_dtype,
        )

    def shutdown(self) -> BufferStats | None:
        """Stop everything this controller started, through its handles. Safe to call twice."""
        final = None
        for engine in getattr(self, "_engines", []):
            try:
                ray.get(engine.shutdown.remote(), timeout=60)
            except Exception:
                pass
            ray.kill(engine, no_restart=True)
        if getattr(self, "_buffer", None) is not None:
            try:
                final = ray.get(self._buffer.close.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(self._buffer, no_restart=True)
        if getattr(self, "_learner", None) is not None:
            self._learner.kill()
        for pool in getattr(self, "_pools", []):
            pool.remove()
        self._engines, self._buffer, self._learner, self._pools = [], None, None, []
        return final


def resolve_backend(cfg: Config) -> str:
    """auto: shared memory when everything runs on this host (a local Ray), gloo across hosts."""
    if cfg.weight_sync.backend != "auto":
        return cfg.weight_sync.backend
    return "gloo" if cfg.ray.address else "shm"


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
