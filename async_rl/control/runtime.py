"""The run's processes: the one object that owns their handles and makes the calls on them.

`Runtime` starts and stops the replay buffer, the generator pool and the learner group, and holds
their Ray handles and addresses. The training loop (controller.py) and the supervisor that detects
and recovers failures (supervisor.py) both go through it; neither keeps a handle of its own, so a
restarted buffer or a replaced engine is seen by both at once.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from async_rl.buffer.actor import BufferAddresses, BufferState, BufferStats, ReplayBuffer
from async_rl.buffer.snapshot import SNAPSHOT_NAME
from async_rl.cluster.placement import PlacementPlan
from async_rl.cluster.pools import RunPools
from async_rl.cluster.resources import PoolShare, ResourcePool, WorkerGroup
from async_rl.config import Config
from async_rl.config.spec import LEARNER_ENV, LearnerSpec
from async_rl.control import settings
from async_rl.control.start_retry import StartRetry
from async_rl.generator.pool import GeneratorPool
from async_rl.reward_models.pool import RewardModelPool
from async_rl.reward_models.server import RewardEndpoint
from async_rl.reward_models.setup import reward_model_pool
from async_rl.security import RunKeys, make_run_keys, warn_insecure
from async_rl.teacher.setup import check_tokenizers, teacher_dir, teacher_pool

START_TIMEOUT_S = 600.0



def learner_actor_options(placement: dict[str, Any]) -> dict[str, Any]:
    """A learner rank's Ray actor options beside its placement: calls at once (a weight sync or buffer
    redirect while train_step waits for a batch, the controller's pending `watch` (death_watch.py), a
    liveness probe beside them), and one malloc arena for the threads that run them
    (learner/host_memory.py: else each pool thread keeps a step's peak, and the rank grows step after step)."""
    return {**placement, "max_concurrency": 4, "runtime_env": {"env_vars": dict(LEARNER_ENV)}}

class Runtime:
    def __init__(
        self,
        cfg: Config,
        run_id: str,
        model_dir: Path,
        run_dir: Path,
        plan: PlacementPlan,
        initial_model_dir: Path,
        learner_cls: type,
    ) -> None:
        """`initial_model_dir`: the run's first weights (the KL reference), kept across resumes.
        `learner_cls`: the class of the learner's ranks (Ray actors made with a LearnerSpec), named by
        the caller: the RL loop's `LearnerDriver`, or SFT's `SftLearner`."""
        self.learner_cls = learner_cls
        self.cfg = cfg
        self.run_id = run_id
        self.model_dir = model_dir
        self.initial_model_dir = initial_model_dir
        self.run_dir = run_dir
        self.plan = plan
        self.keys: RunKeys | None = None  # this run's data-plane CURVE keys (made at start)
        self._buffer: ActorHandle | None = None
        self._addresses: BufferAddresses | None = None
        self._generators: GeneratorPool | None = None
        self._learner: WorkerGroup | None = None
        self._pools: RunPools | None = None
        self._reward_models: RewardModelPool | None = None  # task.reward=judge:/classifier: its replicas
        self._teacher: RewardModelPool | None = None  # teacher.model (algorithm.name=opd): its replicas
        self._generators_version = 0  # the version every engine holds (after the last sync)
        self._acked_step = -1  # the last batch acknowledged to the buffer (repeated to a restarted one)
        self._replayed_steps = 0  # steps trained again after learner restarts (told to a restarted buffer)

    # ---- handles (read-only for everyone else) ----------------------------------------------------

    @property
    def buffer(self) -> ActorHandle:
        assert self._buffer is not None, "runtime not started"
        return self._buffer

    @property
    def addresses(self) -> BufferAddresses:
        assert self._addresses is not None, "runtime not started"
        return self._addresses

    @property
    def generators(self) -> GeneratorPool:
        assert self._generators is not None, "runtime not started"
        return self._generators

    @property
    def learner(self) -> WorkerGroup:
        assert self._learner is not None, "runtime not started"
        return self._learner

    @property
    def reward_models(self) -> RewardModelPool | None:
        return self._reward_models

    def reward_endpoints(self) -> list[RewardEndpoint]:
        return self._reward_models.endpoints() if self._reward_models is not None else []

    @property
    def teacher(self) -> RewardModelPool | None:
        return self._teacher

    def teacher_endpoints(self) -> list[RewardEndpoint]:
        return self._teacher.endpoints() if self._teacher is not None else []

    def served_pools(self) -> dict[str, RewardModelPool]:
        """The pools of replicas served beside the generators, by the kind their deaths are noticed as."""
        pools = {"reward_model": self._reward_models, "teacher": self._teacher}
        return {kind: pool for kind, pool in pools.items() if pool is not None}

    @property
    def generators_version(self) -> int:
        return self._generators_version

    # ---- start and stop --------------------------------------------------------------------------

    def start(self, resume_state: BufferState | None, engines_paused: bool, starts: StartRetry) -> None:
        """Buffer first (restored from `resume_state` before any lease), then the learner ranks and
        the engines, started side by side; then the weight broadcast group. The engines' start is
        retried as a replacement's is (`starts`: generators.start_attempts): a fresh run and a resume
        meet the same failed starts (on a GPU, the previous run's memory not yet freed)."""
        cfg = self.cfg
        if cfg.security.curve:
            self.keys = make_run_keys()
        else:
            warn_insecure()
        self._buffer, self._addresses = self._make_buffer(restore=False)
        if resume_state is not None:
            ray.get(self._buffer.restore.remote(resume_state))
            pos = ray.get(self._buffer.stats.remote()).data_position
            print(f"resumed data position: epoch {pos.epoch}, index {pos.index}", flush=True)
        self._pools = RunPools(cfg)  # colocated on cuda: engine i and learner rank i share GPU bundle i
        self._generators = GeneratorPool(
            # reads the addresses when an engine starts: a restarted buffer has new ones
            lambda i: settings.engine_settings(
                cfg, self.run_id, self.model_dir, self.plan, i, self.addresses.ingest, self.keys, self.reward_endpoints(),
                self.teacher_endpoints(),
            ),
            self._buffer,
            cfg.generators.cpus_per_engine,
            cfg.generators.tensor_parallel_size,
            cfg.weight_sync.timeout_s,
            **self._pools.generator_pool_kwargs(),
        )
        self._reward_models = reward_model_pool(cfg)
        if self._reward_models is not None:  # engines start with its replicas' endpoints
            self._reward_models.start()
        if cfg.teacher.model:  # refused in one line before anything heavy starts
            check_tokenizers(self.model_dir, teacher_dir(cfg))
        self._teacher = teacher_pool(cfg, cfg.generators.max_model_len)
        if self._teacher is not None:
            self._teacher.start()
        n = cfg.generators.num_engines
        say = lambda line: print(f"[start] {line}", flush=True)  # noqa: E731
        if cfg.placement == "colocated":
            # One GPU for both: vLLM sizes its KV cache from what it sees allocated while it starts,
            # so the engines start alone, then the learner sets up in what they left.
            self._learner = self._make_learner()
            starts.run(lambda: self._generators.add(n, paused=engines_paused), f"{n} engine(s)", say)
            ray.get([a.setup.remote() for a in self._learner.actors], timeout=START_TIMEOUT_S)
        else:
            # The learner's ranks are made and set up while vLLM starts (~20-30 s on CPU), once: a
            # failed start of the engines is tried again without them.
            setup: list[ray.ObjectRef] = []

            def make_learner() -> None:
                if self._learner is None:
                    self._learner = self._make_learner()
                    setup.extend(a.setup.remote() for a in self._learner.actors)

            starts.run(lambda: self._generators.add(n, paused=engines_paused, while_starting=make_learner),
                       f"{n} engine(s)", say)
            ray.get(setup, timeout=START_TIMEOUT_S)
        # Joining the weight group is the engines' last step of starting: an engine (or its core) that
        # dies in it is replaced and the group formed again, within the same start attempts.
        tries = iter(range(starts.attempts))
        starts.run(lambda: self._join_first_group(n, engines_paused, retry=next(tries) > 0),
                   f"{n} engine(s) joining the weight group", say)

    def _join_first_group(self, n: int, paused: bool, retry: bool) -> None:
        pool = self._generators
        if retry:  # what died in the previous try goes, and new engines take its place
            for engine_id in pool.find_dead():
                pool.drop_dead(engine_id)
            if len(pool.engines) < n:
                pool.add(n - len(pool.engines), paused=paused)
        pool.rebuild_membership(self._learner.actors[0])

    def learner_spec(self, serve: str) -> LearnerSpec:
        """What every learner rank is started with; `serve`: the buffer's batch-serving address."""
        return settings.learner_spec(self.cfg, self.run_id, self.model_dir, self.initial_model_dir, serve, self.keys)

    def start_learner_alone(self) -> WorkerGroup:
        """train.mode=sft: the learner's ranks (of `learner_cls`) set up, without a buffer, engines or
        weight sync: they read their data themselves."""
        self._pools = RunPools(self.cfg)
        self._learner = self._make_learner()
        ray.get([a.setup.remote() for a in self._learner.actors], timeout=START_TIMEOUT_S)
        return self._learner

    def _make_learner(self, pool: ResourcePool | PoolShare | None = None) -> WorkerGroup:
        """The learner's ranks, in a new resource pool or in `pool` (a restarted group takes its
        predecessor's)."""
        cfg = self.cfg
        assert self._pools is not None
        pool = pool if pool is not None else self._pools.learner()
        spec = self.learner_spec(self._addresses.serve if self._addresses is not None else "")
        world, ranks = cfg.learner.world_size, self.plan.learner_ranks

        def make(rank: int, options: dict[str, Any], master: str) -> ActorHandle:
            options = learner_actor_options(options)
            return ray.remote(self.learner_cls).options(**options).remote(spec, rank, world, master, ranks[rank].cores)

        return WorkerGroup(pool, make, lambda a: ray.get(a.rendezvous_address.remote()))

    def _make_buffer(self, restore: bool) -> tuple[ActorHandle, BufferAddresses]:
        """A buffer actor that snapshots into the run directory (and restores from it on a restart)."""
        s = msgspec.structs.replace(
            settings.buffer_settings(self.cfg, self.run_id, self.keys, self.model_dir),
            snapshot_path=str(self.run_dir / SNAPSHOT_NAME),
            restore=restore,
        )
        name = f"buffer-{self.run_id}-{time.time_ns()}"
        # On the controller's node: its snapshot goes to the run directory there, where a restart reads it.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        buffer = ray.remote(ReplayBuffer).options(num_cpus=0, name=name, scheduling_strategy=here).remote(s)
        return buffer, ray.get(buffer.start.remote(), timeout=START_TIMEOUT_S)

    def shutdown(self) -> BufferStats | None:
        """Stop every process, through its handle. Safe to call twice."""
        final = None
        if self._generators is not None:
            self._generators.shutdown()
        if self._reward_models is not None:
            self._reward_models.shutdown()
            self._reward_models = None
        if self._teacher is not None:
            self._teacher.shutdown()
            self._teacher = None
        if self._buffer is not None:
            try:
                final = ray.get(self._buffer.close.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(self._buffer, no_restart=True)
        if self._learner is not None:
            try:
                self._learner.call(lambda a: a.shutdown.remote(), timeout_s=30)
            except Exception:
                pass  # a dead or wedged rank is killed below all the same
            self._learner.kill()
        if self._pools is not None:
            self._pools.remove()
        self._generators, self._buffer, self._learner, self._pools = None, None, None, None
        return final

    # ---- the calls the training loop makes --------------------------------------------------------

    def start_train_step(self, step: int) -> list[ray.ObjectRef]:
        """Every learner rank fetches its shard of batch `step` and trains on it."""
        return [a.train_step.remote(step) for a in self.learner.actors]

    def ack_batch(self, step: int) -> int:
        """Every rank finished step `step`: its samples count `trained` in the buffer."""
        samples = ray.get(self.buffer.ack_batch.remote(step), timeout=START_TIMEOUT_S)
        self._acked_step = step
        return samples

    def buffer_stats(self) -> BufferStats:
        return ray.get(self.buffer.stats.remote(), timeout=START_TIMEOUT_S)

    def buffer_checkpoint_state(self) -> BufferState:
        return ray.get(self.buffer.checkpoint_state.remote(), timeout=START_TIMEOUT_S)

    def generation_settled(self, wait_s: float) -> bool:
        """train.deterministic: everything admitted at the engines' version has arrived (waits up to `wait_s`)."""
        return ray.get(self.buffer.generation_settled.remote(wait_s), timeout=wait_s + START_TIMEOUT_S)

    def buffer_alive(self) -> bool:
        try:
            ray.get(self.buffer.stats.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return False
        return True

    def sync_weights(self, version: int, during_step: bool = False) -> bool:
        """One attempt to move learner weights of `version` into every engine (see GeneratorPool.sync).
        False: the learner already trained past `version`, or (`during_step`) a sharded learner would
        need a collective gather while its ranks are in the step; the sync after its step delivers."""
        # Sharded learners gather to rank 0, each rank under its weights lock, so never mid-step.
        if not all(self.learner.call(lambda a: a.gather_weights.remote(version, during_step))):
            return False  # the learner trained past `version`: the sync after its step delivers
        sender = self.learner.actors[0]
        # A sync while train_step waits (recovery) must not send weights the step is changing.
        if not ray.get(sender.pin_weights.remote(version), timeout=START_TIMEOUT_S):
            return False
        try:
            if self.cfg.placement == "colocated":
                # The sync wakes the engines into this GPU's memory: the learner gives back what it
                # does not need first (gradients only between steps; see learner/gpu_memory.py).
                self.learner.call(lambda a: a.release_gpu_memory.remote(not during_step))
            self.generators.sync(sender, version)
        finally:
            try:
                ray.get(sender.unpin_weights.remote(), timeout=START_TIMEOUT_S)
            except ray.exceptions.RayError:
                pass  # a dead sender holds nothing
        self._generators_version = version
        return True

    def engines_hold(self, version: int) -> None:
        """The engines started from a checkpoint of `version` (a resume): they hold it without a sync."""
        self._generators_version = version

    def tell_buffer_version(self) -> None:
        ray.get(self.buffer.set_generator_version.remote(self._generators_version), timeout=START_TIMEOUT_S)

    def dead_learner_rank(self) -> int | None:
        for rank, actor in enumerate(self.learner.actors):
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=30)
            except ray.exceptions.RayActorError:
                return rank
            except ray.exceptions.GetTimeoutError:
                pass  # busy is not dead
        return None

    # ---- recovery (called by the supervisor) ------------------------------------------------------

    def served_replicas_moved(self, kind: str) -> None:
        """Replicas of the served pool `kind` (served_pools) were started anew at new addresses: every
        engine's reward workers (a reward model) or teacher scorer (the teacher) calls them there."""
        if kind == "teacher":
            endpoints = self.teacher_endpoints()
            ray.get([a.set_teacher_endpoints.remote(endpoints) for a in self.generators.actors], timeout=START_TIMEOUT_S)
        else:
            endpoints = self.reward_endpoints()
            ray.get([a.set_reward_endpoints.remote(endpoints) for a in self.generators.actors], timeout=START_TIMEOUT_S)

    def restart_learner(self, checkpoint_dir: str | None, from_step: int) -> None:
        """Kill every rank of the learner group (a dead one, and the others, likely stuck in a
        collective with it), start fresh ranks in the same resources, restore `checkpoint_dir` (None:
        they keep the initial weights they start with), and form a new broadcast group with the engines.
        The learner goes on from step `from_step`: the acknowledged steps from there on are trained
        again, and the buffer's admission lets their batches in (see buffer/ledger.py)."""
        old = self.learner
        old.kill()  # by handle: no rank's process is left behind
        self._learner = self._make_learner(old.pool)
        ray.get([a.setup.remote() for a in self._learner.actors], timeout=START_TIMEOUT_S)
        if checkpoint_dir is not None:
            self._learner.call(lambda a: a.load_checkpoint.remote(checkpoint_dir), timeout_s=START_TIMEOUT_S)
        # Counted once: the learner is back at `from_step`, so a second restart before its next ack adds nothing.
        self._replayed_steps += max(0, self._acked_step + 1 - from_step)
        self._acked_step = min(self._acked_step, from_step - 1)
        ray.get(self.buffer.set_replayed_steps.remote(self._replayed_steps), timeout=START_TIMEOUT_S)
        self.generators.learner_replaced(self._learner.actors[0])

    def restart_buffer(self) -> None:
        """A new buffer from the last snapshot; engines and learner ranks reconnect to it, and it
        learns the generators' version and the last acknowledged batch (an ack lost with the old one)."""
        try:
            ray.kill(self.buffer, no_restart=True)
        except Exception:
            pass
        self._buffer, self._addresses = self._make_buffer(restore=True)
        ray.get(self._buffer.set_generator_version.remote(self._generators_version), timeout=START_TIMEOUT_S)
        if self._replayed_steps:
            ray.get(self._buffer.set_replayed_steps.remote(self._replayed_steps), timeout=START_TIMEOUT_S)
        if self._acked_step >= 0:
            ray.get(self._buffer.ack_batch.remote(self._acked_step), timeout=START_TIMEOUT_S)
        self.generators.reconnect(self._buffer, self._addresses.ingest)
        ray.get([a.redirect_buffer.remote(self._addresses.serve) for a in self.learner.actors], timeout=START_TIMEOUT_S)
