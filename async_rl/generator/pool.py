"""The generator pool: engines that come and go, each in its own resource pool, and the weight
broadcast membership that follows them.

Adding or removing an engine marks the membership stale; the next weight sync first rebuilds the
broadcast group (a new generation on the learner's rendezvous store, every engine rejoining) and
then moves the weights, so the learner never restarts. An added engine starts paused and generates
only after it received the current weights.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.actor import ActorHandle

from async_rl.cluster.resources import PoolShare, ResourcePool, actor_key, unhealthy_actors
from async_rl.errors import RunError
from async_rl.generator.engine import EnginePids, EngineSettings, EngineStats, GeneratorEngine
from async_rl.weight_sync.base import UpdateReceipt, WeightGroupInfo
from async_rl.weight_sync.checksum import ParamChecksum, ShardChecksum
from async_rl.weight_sync.gloo import abort_membership
from async_rl.weight_sync.verify import SyncOutcome, verified_update

TIMEOUT_S = 600.0
LEARNER = -1  # the learner's rank 0 (the sender), as a member in abort_sync
GATHER_LOOK_S = 0.5  # how often a sync's wait looks whether a member was found dead meanwhile


@dataclass
class EngineHandle:
    engine_id: int
    actor: ActorHandle
    pool: ResourcePool | None  # its own pool; None: a slot of the shared (colocated) pool
    slot: int = -1  # the shared pool's bundle it runs in
    started: bool = False  # its start returned (before, its event loop may be busy starting vLLM)


@dataclass
class StartingEngine:
    """An engine started in the background (launch): a member once poll_starts finds it started."""

    handle: EngineHandle
    ready: ray.ObjectRef  # its start call, failed once time.monotonic() passes `deadline`
    deadline: float
    buffer: ActorHandle  # the buffer it was made with: one restarted meanwhile is handed over when it joins


class GeneratorPool:
    def __init__(
        self,
        make_settings: Callable[[int], EngineSettings],
        buffer: ActorHandle,
        cpus_per_engine: int,
        workers_per_engine: int,
        weight_timeout_s: float,
        ray_resources: dict[str, float] | None = None,
        gpus_per_engine: int = 0,
        shared: PoolShare | None = None,
        actor_cls: type = GeneratorEngine,
    ) -> None:
        """`ray_resources`: custom Ray resources each engine's bundle asks for besides its CPUs (the
        nodes it may land on). `gpus_per_engine`: GPUs in each engine's bundle (its tensor-parallel
        size on cuda, so vLLM's TP workers get exactly these; 0 on cpu). `shared`: colocated on cuda,
        engines run in the bundles of this share (one per GPU, a learner rank in each too) instead of
        a pool of their own. `actor_cls`: the engine actor (tests place probes the same way)."""
        self.make_settings = make_settings
        self.actor_cls = actor_cls
        gpus = {"GPU": float(gpus_per_engine)} if gpus_per_engine else {}
        self.bundle = {"CPU": cpus_per_engine, **gpus, **(ray_resources or {})}
        self.shared = shared
        self.buffer = buffer
        self.cpus_per_engine = cpus_per_engine
        self.workers_per_engine = workers_per_engine
        self.weight_timeout_s = weight_timeout_s
        self.engines: dict[int, EngineHandle] = {}
        self.starting: dict[int, StartingEngine] = {}  # launched, not yet members (see launch)
        self._ingest_address: str | None = None  # the restarted buffer's, for engines that join after it
        self._next_id = 0
        self.membership_stale = True
        self._group: WeightGroupInfo | None = None  # the current broadcast membership
        # Members found dead or hung by the run's watcher (engine id; LEARNER for the sender), set on
        # its thread: every wait of a sync gives up while one of them is still in the pool.
        self._abandoned: dict[int, str] = {}
        # Taking an engine out of the pool and the watcher's abandoning it are one step each under
        # this lock: a late abandon (the loop replaced the engine first) must not outlive the engine,
        # or every later sync gives up on a member that is gone and finds nothing to replace.
        self._members = threading.Lock()
        self.last_sync = SyncOutcome()  # what the last sync moved (the step's record)
        self.delta_fallbacks = 0  # delta updates whose served checksum disagreed, so far (a full one followed)

    @property
    def actors(self) -> list[ActorHandle]:
        return [h.actor for h in self.engines.values()]

    def add(self, count: int, paused: bool, while_starting: Callable[[], None] | None = None) -> list[int]:
        """Start `count` engines (in parallel; vLLM start-up takes ~30 s each on CPU). `while_starting`
        runs once their start-up is under way, before waiting for it (a run's start makes its learner
        then); should it raise, the new engines are stopped."""
        new: list[EngineHandle] = []
        try:
            for _ in range(count):
                handle = self._new_engine()
                self.engines[handle.engine_id] = handle  # registered first, so shutdown finds a half-started engine
                new.append(handle)
            starts = [h.actor.start.remote(paused) for h in new]
            if while_starting is not None:
                while_starting()
            ray.get(starts, timeout=TIMEOUT_S)
            for h in new:
                h.started = True
        except Exception:
            # No room for another engine (or one failed to start): the pool stays as it was.
            for h in new:
                if h.engine_id in self.engines:
                    self._take_out(h.engine_id)
                self._stop(h)
            raise
        self.membership_stale = True
        return [h.engine_id for h in new]

    def launch(self, count: int, paused: bool) -> list[int]:
        """Start `count` engines without waiting: each joins the pool (paused until a sync gave it the
        weights) when poll_starts finds it started. Raises only when there is no room for one."""
        new: list[int] = []
        for _ in range(count):
            h = self._new_engine()
            deadline = time.monotonic() + TIMEOUT_S
            self.starting[h.engine_id] = StartingEngine(h, h.actor.start.remote(paused), deadline, self.buffer)
            new.append(h.engine_id)
        return new

    def poll_starts(self) -> tuple[list[int], list[tuple[int, BaseException]]]:
        """Without waiting: launched engines that started join the pool (the next sync rebuilds the
        membership), those whose start failed or passed TIMEOUT_S stop. Returns (joined, [(id, why)])."""
        joined: list[int] = []
        failed: list[tuple[int, BaseException]] = []
        for engine_id, s in list(self.starting.items()):
            done, _ = ray.wait([s.ready], timeout=0)
            if not done and time.monotonic() < s.deadline:
                continue
            del self.starting[engine_id]
            try:
                if not done:
                    raise TimeoutError(f"engine {engine_id} did not start within {TIMEOUT_S:.0f}s")
                ray.get(s.ready)
                if s.buffer is not self.buffer:  # the buffer was restarted while it started
                    ray.get(s.handle.actor.reconnect.remote(self.buffer, self._ingest_address), timeout=TIMEOUT_S)
            except Exception as exc:
                self._stop(s.handle)
                failed.append((engine_id, exc))
                continue
            s.handle.started = True
            with self._members:
                self.engines[engine_id] = s.handle
            self.membership_stale = True
            joined.append(engine_id)
        return joined, failed

    def cancel_starts(self) -> None:
        """Stop every engine still starting in the background."""
        for engine_id in list(self.starting):
            self._stop(self.starting.pop(engine_id).handle)

    def _new_engine(self) -> EngineHandle:
        """A new engine's actor, in the room for it; not started yet."""
        engine_id, self._next_id = self._next_id, self._next_id + 1
        pool, slot, options = self._room(engine_id)
        actor = ray.remote(self.actor_cls).options(**options, max_concurrency=1000).remote(
            self.make_settings(engine_id), self.buffer)
        return EngineHandle(engine_id, actor, pool, slot)

    def _room(self, engine_id: int) -> tuple[ResourcePool | None, int, dict]:
        """Where a new engine runs: a pool of its own, or the first free slot of the shared pool."""
        if self.shared is None:
            pool = ResourcePool(f"engine-{engine_id}", [self.bundle])
            return pool, -1, pool.actor_options(0)
        taken = {h.slot for h in self.engines.values()} | {s.handle.slot for s in self.starting.values()}
        free = [i for i in range(len(self.shared)) if i not in taken]
        if not free:
            raise RunError(
                f"placement=colocated: every GPU of the shared pool already holds an engine ({len(self.shared)})"
            )
        return None, free[0], self.shared.actor_options(free[0])

    def remove(self, engine_id: int, drain_timeout_s: float) -> int:
        """Drain one engine, then stop it: it takes no new lease, its requests in flight finish (up to
        `drain_timeout_s`), and what is still leased goes back to the prompt pool. Returns how many
        prompts went back."""
        handle = self._take_out(engine_id)
        ray.get(self.buffer.close_engine.remote(engine_id), timeout=TIMEOUT_S)
        try:
            ray.get(handle.actor.drain.remote(drain_timeout_s), timeout=drain_timeout_s + 30)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # dead or wedged: what it held is handed back below all the same
        self._stop(handle)
        return ray.get(self.buffer.requeue.remote(engine_id), timeout=TIMEOUT_S)

    def drop_dead(self, engine_id: int) -> int | None:
        """An engine that died: kill what is left of it, hand its leases back. Returns how many, or
        None when the buffer is dead too (its restart from the snapshot requeues every lease)."""
        handle = self._take_out(engine_id)
        ray.kill(handle.actor, no_restart=True)
        if handle.pool is not None:
            handle.pool.remove()
        try:
            return ray.get(self.buffer.requeue.remote(engine_id), timeout=TIMEOUT_S)
        except ray.exceptions.RayActorError:
            return None

    def _take_out(self, engine_id: int) -> EngineHandle:
        with self._members:
            handle = self.engines.pop(engine_id)
            self._abandoned.pop(engine_id, None)
        self.membership_stale = True
        return handle

    def find_dead(self, timeout_s: float = 10.0) -> list[int]:
        """Engines whose actor died or whose vLLM engine core died. A slow reply is not death."""
        return unhealthy_actors({eid: h.actor.healthy.remote() for eid, h in self.engines.items()}, timeout_s)

    def reconnect(self, buffer: ActorHandle, ingest_address: str) -> None:
        """A restarted buffer: every engine leases from and pushes to the new one."""
        self.buffer = buffer
        self._ingest_address = ingest_address
        ray.get([a.reconnect.remote(buffer, ingest_address) for a in self.actors], timeout=TIMEOUT_S)

    def rebuild_membership(self, sender: ActorHandle) -> None:
        """A new broadcast group: learner rank 0 plus every worker of every current engine."""
        tp = self.workers_per_engine
        self.membership_stale = True  # until every member is in
        info = self._group = ray.get(sender.open_weight_group.remote(1 + len(self.engines) * tp))
        manifest = ray.get(sender.weight_manifest.remote())
        joins = [h.actor.join_weight_group.remote(info, 1 + i * tp, manifest) for i, h in enumerate(self.engines.values())]
        self._gather([sender.join_weight_group.remote(), *joins], self.weight_timeout_s, "joining the weight group")
        self.membership_stale = False

    def learner_replaced(self, sender: ActorHandle) -> None:
        """The learner group was restarted on fresh actors (supervisor.py): syncs stop treating the
        learner as abandoned, and a new broadcast group forms around the new rank 0 `sender`."""
        self._abandoned.pop(LEARNER, None)
        self.rebuild_membership(sender)

    def abandoned_engines(self) -> list[int]:
        """Engines of the pool a sync stopped waiting for (the watcher found them dead or hung): the
        caller replaces them even when its own health check has not seen the death yet."""
        with self._members:
            return sorted(m for m in self._abandoned if m in self.engines)

    def abort_sync(self, member: int, reason: str, actor_id: str | None = None) -> None:
        """A member (engine id, or LEARNER) died or hangs, seen by the run's watcher on its thread: a
        weight sync in flight stops waiting for it at once (every call of it, the pause and resume
        too: a stopped engine never answers them), and so does every sync until the engine left the
        pool; the next sync builds a new group (an aborted one stays aborted). `actor_id`: the engine
        instance found dead; one the loop already took out of the pool (it got there first, by its
        own health check or this notice) is not abandoned, and the group of its successor not aborted."""
        with self._members:
            if member != LEARNER:
                handle = self.engines.get(member)
                if handle is None or (actor_id is not None and actor_key(handle.actor) != actor_id):
                    return
            self._abandoned[member] = reason
            group = self._group
        if group is not None:
            abort_membership(group, reason)
        self.membership_stale = True

    def sleep(self) -> None:
        """Colocated placement: stop generating while the learner trains (woken by the next sync)."""
        ray.get([a.sleep.remote() for a in self.actors], timeout=TIMEOUT_S)

    def sync(self, sender: ActorHandle, version: int) -> float:
        """Pause every engine (requests kept), broadcast, verify, set the version, resume. A dead
        member makes this raise (a Ray error, or the group's timeout); the caller recovers."""
        t0 = time.perf_counter()
        if self.membership_stale:
            self.rebuild_membership(sender)
        actors = self.actors
        self._gather([a.pause.remote() for a in actors], TIMEOUT_S, "pausing")  # also wakes a sleeping engine

        def update(full: bool) -> tuple[UpdateReceipt, dict[int, list[UpdateReceipt]]]:
            # the first try as tests may strike it (their _broadcast takes no `full`)
            started = self._broadcast(sender, actors, version, full=True) if full else self._broadcast(sender, actors, version)
            return self._update(*started, version)

        self.last_sync = verified_update(update, version, self.fell_back)
        ray.get([a.resume.remote(version) for a in actors], timeout=TIMEOUT_S)
        return time.perf_counter() - t0

    def fell_back(self, message: str) -> None:
        """weight_sync.delta: a delta was refused or served wrong and a full update follows (counted)."""
        self.delta_fallbacks += 1
        print(f"[weight-sync] {message} ({self.delta_fallbacks} so far)", file=sys.stderr, flush=True)

    def _update(
        self, sent: ray.ObjectRef, received: list[ray.ObjectRef], version: int
    ) -> tuple[UpdateReceipt, dict[int, list[UpdateReceipt]]]:
        """Wait for one update's sender and receivers and check every receipt; returns the sender's
        receipt and every engine's (one per TP worker), by engine id."""
        try:
            ours, *per_engine = self._gather([sent, *received], TIMEOUT_S, f"weight update v{version}")
        except ray.exceptions.RayTaskError as exc:
            # A receiver refused the update (CorruptUpdate; its engine stays paused, never serving
            # it), or a member died and the others abandoned it (SyncAborted).
            self.membership_stale = True
            raise RunError(f"weight update v{version} failed: {str(exc).strip().splitlines()[-1]}") from None
        engines: dict[int, list[UpdateReceipt]] = dict(zip(self.engines, per_engine, strict=True))
        for engine_id, receipts in engines.items():
            for r in receipts:
                if (r.checksum, r.manifest_digest) != (ours.checksum, ours.manifest_digest):
                    raise RunError(f"weight update v{version}: engine {engine_id} received a corrupt update")
                if ours.served is not None and (r.served is None or not r.served.close_to(ours.served)):
                    raise RunError(adapter_mismatch(version, engine_id, ours.served, r.served))
        return ours, engines

    def _gather(self, refs: list[ray.ObjectRef], timeout_s: float, what: str) -> list:
        """ray.get of every ref, but the first failure (a dead engine or engine core, a refused
        update) raises at once, and first aborts the weight group so every other member stops
        waiting for the failed one (see weight_sync/gloo.py)."""
        pending, deadline = list(refs), time.monotonic() + timeout_s
        try:
            while pending:
                left = deadline - time.monotonic()
                done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, min(left, GATHER_LOOK_S)))
                if done:
                    ray.get(done[0])
                    continue
                with self._members:  # written by the watcher's thread
                    abandoned = dict(self._abandoned)
                if abandoned:
                    raise RunError(f"{what}: abandoned: {'; '.join(abandoned.values())}")
                if left <= GATHER_LOOK_S:
                    raise TimeoutError(f"{what}: no answer within {timeout_s:.0f}s")
        except Exception as exc:
            if self._group is not None:
                # on a thread of its own: a store gone with a dead sender (learner rank 0 hosts it)
                # takes the connect timeout (5 s) to give up, and the caller's recovery must not wait;
                # a late abort reaches only this membership's generation, never the rebuilt one's
                reason = f"{what}: {type(exc).__name__}"
                threading.Thread(target=abort_membership, args=(self._group, reason), daemon=True).start()
            self.membership_stale = True
            raise
        return ray.get(refs)

    def _broadcast(self, sender: ActorHandle, actors: list[ActorHandle], version: int, full: bool = False):
        """Start the sender and every receiver (one method, so a test can strike in the middle).
        `full`: a full update even where a delta could go (the fall-back)."""
        return sender.broadcast_weights.remote(version, full), [a.receive_weights.remote(version) for a in actors]

    def pids(self) -> dict[int, EnginePids]:
        return dict(zip(self.engines, ray.get([a.pids.remote() for a in self.actors], timeout=TIMEOUT_S), strict=True))

    def stats(self) -> list[EngineStats]:
        """Every engine that answers. One that died since the supervisor's last check is left out
        (the next check replaces it): a run whose last step is done must not fail on its summary."""
        out: list[EngineStats] = []
        for ref in [a.stats.remote() for a in self.actors]:
            try:
                out.append(ray.get(ref, timeout=60))
            except ray.exceptions.RayError:
                continue
        return out

    def model_runners(self) -> dict[int, str]:
        """The model runner every engine's workers run, by engine id."""
        return dict(zip(self.engines, ray.get([a.model_runner.remote() for a in self.actors]), strict=True))

    def checksums(self) -> dict[int, list[ShardChecksum]]:
        """Every engine's TP workers' checksum parts, by engine id (see checksum.engine_checksum)."""
        return dict(zip(self.engines, ray.get([a.param_checksums.remote() for a in self.actors]), strict=True))

    def _stop(self, handle: EngineHandle) -> None:
        try:
            ray.get(handle.actor.shutdown.remote(), timeout=60)
        except Exception:
            pass  # a dead or wedged engine is killed below all the same
        ray.kill(handle.actor, no_restart=True)
        if handle.pool is not None:
            handle.pool.remove()

    def shutdown(self) -> None:
        self.cancel_starts()
        for handle in list(self.engines.values()):
            self._stop(handle)
        self.engines.clear()


def adapter_mismatch(version: int, engine_id: int, learner: ParamChecksum, served: ParamChecksum | None) -> str:
    """One line: the adapter an engine serves after update `version` is not the learner's."""
    got = "none" if served is None else f"sum {served.total:.9g} over {served.count} values"
    return (
        f"weight update v{version}: engine {engine_id} serves another LoRA adapter than the learner's "
        f"(read back from vLLM: {got}; learner: sum {learner.total:.9g} over {learner.count} values); stopping"
    )
