"""The reward model's replicas beside the generator pool: each a Ray actor in a placement group of its
own (its CPUs, its GPUs on cuda), started with the run, never trained or weight-synced. A replica that
died (its actor, or the judge's vLLM engine core) is found and restarted by the supervisor as a dead
generator engine is (supervisor.py: `recover`), at a new address that every engine then gets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.actor import ActorHandle

from async_rl.cluster.resources import ResourcePool, unhealthy_actors
from async_rl.errors import RunError
from async_rl.reward_models.server import ReplicaPids, ReplicaStats, RewardEndpoint, RewardModelServer

START_TIMEOUT_S = 600.0


@dataclass
class ReplicaHandle:
    replica_id: int
    actor: ActorHandle
    pool: ResourcePool
    endpoint: RewardEndpoint | None = None  # set once started


class RewardModelPool:
    def __init__(
        self,
        name: str,
        server_cls: type[RewardModelServer],
        make_settings: Callable[[int], object],
        replicas: int,
        bundle: dict[str, float],
    ) -> None:
        """`make_settings(replica_id)`: what `server_cls` is started with; `bundle`: each replica's Ray
        resources (CPU, GPU on cuda, custom ones)."""
        self.name = name
        self.server_cls = server_cls
        self.make_settings = make_settings
        self.replicas = replicas
        self.bundle = bundle
        self.handles: dict[int, ReplicaHandle] = {}
        self.restarts = 0  # dead replicas started anew
        self._starts = 0  # placement groups made: each gets a name of its own (a removed one may linger)

    def start(self) -> None:
        """Every replica, started side by side (a judge's vLLM takes ~30 s on CPU)."""
        self._start(list(range(self.replicas)))

    def _start(self, ids: list[int]) -> None:
        new = []
        try:
            for replica_id in ids:
                self._starts += 1
                pool = ResourcePool(f"{self.name}-{replica_id}-{self._starts}", [self.bundle])
                actor = ray.remote(self.server_cls).options(**pool.actor_options(0), max_concurrency=1000).remote(
                    self.make_settings(replica_id)
                )
                handle = self.handles[replica_id] = ReplicaHandle(replica_id, actor, pool)
                new.append(handle)
            endpoints = ray.get([h.actor.start.remote() for h in new], timeout=START_TIMEOUT_S)
        except Exception as exc:
            for h in new:
                self.handles.pop(h.replica_id, None)
                self._stop(h)
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            raise RunError(f"{self.name} replica(s) {ids} did not start: {lines[-1].strip()}") from None
        for h, endpoint in zip(new, endpoints, strict=True):
            h.endpoint = endpoint

    def actors(self) -> dict[int, ActorHandle]:
        """Every replica's actor by replica id (a snapshot)."""
        return {rid: h.actor for rid, h in list(self.handles.items())}

    def serving(self) -> set[int]:
        """The replicas whose start returned (a starting one may not answer a probe for a while)."""
        return {rid for rid, h in list(self.handles.items()) if h.endpoint is not None}

    def endpoints(self) -> list[RewardEndpoint]:
        return [h.endpoint for h in self.handles.values() if h.endpoint is not None]

    def find_dead(self, timeout_s: float = 10.0) -> list[int]:
        """Replicas whose actor died or that cannot serve (the judge's engine core died). Slow is not dead."""
        return unhealthy_actors({rid: h.actor.healthy.remote() for rid, h in self.handles.items()}, timeout_s)

    def restart(self, dead: list[int]) -> None:
        """Kill what is left of each dead replica and start it anew (same id, a new address). A start
        that failed left no handle: called again, it starts them again (the supervisor's retry)."""
        for rid in dead:
            handle = self.handles.pop(rid, None)
            if handle is not None:
                ray.kill(handle.actor, no_restart=True)
                handle.pool.remove()
        self._start(dead)
        self.restarts += len(dead)

    def stats(self) -> list[ReplicaStats]:
        """Every replica that answers (a dead one is left out until it is restarted)."""
        out = []
        for ref in [h.actor.stats.remote() for h in self.handles.values()]:
            try:
                out.append(ray.get(ref, timeout=60))
            except ray.exceptions.RayError:
                continue
        return out

    def pids(self) -> dict[int, ReplicaPids]:
        refs = [h.actor.pids.remote() for h in self.handles.values()]
        return dict(zip(self.handles, ray.get(refs, timeout=60), strict=True))

    def _stop(self, handle: ReplicaHandle) -> None:
        try:
            ray.get(handle.actor.shutdown.remote(), timeout=60)
        except Exception:
            pass  # dead or wedged: killed below all the same
        ray.kill(handle.actor, no_restart=True)
        handle.pool.remove()

    def shutdown(self) -> None:
        for handle in list(self.handles.values()):
            self._stop(handle)
        self.handles.clear()
