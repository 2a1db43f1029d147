"""ResourcePool over Ray placement groups, and WorkerGroup: R ranked actors with typed fan-out.

Socket helpers (free ports, advertised addresses) live in `cluster/net.py`, which needs no Ray.

Calls are ordinary actor methods passed as callables (`wg.call(lambda a: a.train_step.remote(k))`),
never method names in strings.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import ray
from ray.actor import ActorHandle
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from async_rl.errors import RunError

T = TypeVar("T")
S = TypeVar("S")


class ResourcePool:
    """One placement group: a bundle per process, packed on one node or spread across nodes."""

    def __init__(
        self,
        name: str,
        bundles: list[dict[str, float]],
        strategy: str = "PACK",
        timeout_s: float = 120.0,
    ) -> None:
        self.name = name
        self.bundles = bundles
        self.pg = placement_group(bundles, strategy=strategy, name=f"async_rl-{name}")
        try:
            ray.get(self.pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            raise RunError(
                f"resource pool '{name}' ({len(bundles)} bundles, the first {bundles[0]}) could not be placed "
                f"within {timeout_s:.0f}s; the cluster has {ray.cluster_resources()}, free "
                f"{ray.available_resources()}"
            ) from None

    def __len__(self) -> int:
        return len(self.bundles)

    def actor_options(self, index: int, cpus: float | None = None, gpus: float | None = None) -> dict[str, Any]:
        """Options that run an actor in bundle `index`, with the whole bundle's CPUs and GPUs, or the
        share given (two processes sharing one bundle). Ray sets the actor's CUDA_VISIBLE_DEVICES to
        the bundle's GPUs: an actor that asks for none would see every GPU of its node (Ray 2.60)."""
        bundle = self.bundles[index]
        return {
            "num_cpus": bundle.get("CPU", 0) if cpus is None else cpus,
            "num_gpus": bundle.get("GPU", 0) if gpus is None else gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=index
            ),
        }

    def share(self, count: int, cpus: float, gpus: float) -> PoolShare:
        """The first `count` bundles, each run with `cpus` and `gpus` of its bundle (colocated)."""
        return PoolShare(self, count, cpus, gpus)

    def remove(self) -> None:
        remove_placement_group(self.pg)


class PoolShare:
    """Part of each of a pool's first `count` bundles: what a WorkerGroup or an engine runs in when two
    processes share one bundle (a colocated engine and learner rank on one GPU). Removing it is the
    owner's business, not the share's."""

    def __init__(self, pool: ResourcePool, count: int, cpus: float, gpus: float) -> None:
        if count > len(pool):
            raise ValueError(f"{count} shares of a {len(pool)}-bundle pool")
        self.pool, self.count, self.cpus, self.gpus = pool, count, cpus, gpus

    def __len__(self) -> int:
        return self.count

    def actor_options(self, index: int) -> dict[str, Any]:
        return self.pool.actor_options(index, cpus=self.cpus, gpus=self.gpus)


class WorkerGroup(Generic[T]):
    """R actors of one class in a ResourcePool, SPMD among themselves.

    `make(rank, options)` creates rank `rank`'s actor handle with the pool's `options` (the caller
    passes rank, world size and the rendezvous address to the constructor). Rank 0 is created first;
    `rendezvous(actor0)` returns the address the other ranks are told.
    """

    def __init__(
        self,
        pool: ResourcePool | PoolShare,
        make: Callable[[int, dict[str, Any], str], ActorHandle],
        rendezvous: Callable[[ActorHandle], str],
    ) -> None:
        self.pool = pool
        rank0 = make(0, pool.actor_options(0), "")
        self.address = rendezvous(rank0)
        self.actors: list[ActorHandle] = [rank0] + [
            make(r, pool.actor_options(r), self.address) for r in range(1, len(pool))
        ]

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def call(self, fn: Callable[[ActorHandle], ray.ObjectRef], timeout_s: float | None = None) -> list[Any]:
        """Call `fn(actor)` on every rank; collect results in rank order."""
        return ray.get([fn(a) for a in self.actors], timeout=timeout_s)

    def call_sharded(
        self, fn: Callable[[ActorHandle, S], ray.ObjectRef], shards: Sequence[S], timeout_s: float | None = None
    ) -> list[Any]:
        """Call `fn(actor_r, shards[r])` on every rank r; collect results in rank order."""
        if len(shards) != len(self.actors):
            raise ValueError(f"{len(shards)} shards for {len(self.actors)} ranks")
        return ray.get([fn(a, s) for a, s in zip(self.actors, shards, strict=True)], timeout=timeout_s)

    def kill(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)


def unhealthy_actors(health: dict[int, ray.ObjectRef], timeout_s: float) -> list[int]:
    """The ids whose `healthy` call (issued for all of them first, so they answer in parallel) said
    False or whose actor died. A reply slower than `timeout_s` is not death: it is left out."""
    dead = []
    for key, ref in health.items():
        try:
            if not ray.get(ref, timeout=timeout_s):
                dead.append(key)
        except ray.exceptions.RayActorError:
            dead.append(key)
        except ray.exceptions.GetTimeoutError:
            pass
    return dead


def actor_key(actor: ActorHandle) -> str:
    return actor._actor_id.hex()
