"""The run's Ray resource pools, made from the placement plan's bundles (placement.py).

One object so the run (runtime.py) and the placement tests make them the same way: the learner's
pool (one bundle per rank), and what each engine runs in (a pool of its own per engine, or, colocated
on cuda, a slot of one shared pool whose bundle i holds engine i and learner rank i).
"""

from __future__ import annotations

from typing import Any

from async_rl.cluster import placement
from async_rl.cluster.resources import PoolShare, ResourcePool
from async_rl.config import Config


class RunPools:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self._pools: list[ResourcePool] = []
        self.shared: ResourcePool | None = None
        if placement.shares_gpus(cfg):
            self.shared = self._add(ResourcePool("colocated", placement.colocated_bundles(cfg)))

    def _add(self, pool: ResourcePool) -> ResourcePool:
        self._pools.append(pool)
        return pool

    def learner(self) -> ResourcePool | PoolShare:
        """Where the learner ranks run (made once, before the engines: the plan's order)."""
        cfg = self.cfg
        if self.shared is not None:
            return self.shared.share(cfg.learner.world_size, cfg.learner.cpus_per_rank, placement.COLOCATED_GPU_SHARE)
        # On cuda one GPU per rank, torch or megatron: Ray sets its CUDA_VISIBLE_DEVICES to it.
        return self._add(ResourcePool("learner", [placement.learner_bundle(cfg)] * cfg.learner.world_size))

    def generator_pool_kwargs(self) -> dict[str, Any]:
        """GeneratorPool's placement arguments: each engine's GPUs, or the shared pool's slots."""
        g = self.cfg.generators
        shared = None
        if self.shared is not None:
            shared = self.shared.share(len(self.shared), g.cpus_per_engine, placement.COLOCATED_GPU_SHARE)
        return {
            "ray_resources": g.ray_resources,
            "gpus_per_engine": g.tensor_parallel_size if placement.generators_on_cuda(self.cfg) else 0,
            "shared": shared,
        }

    def remove(self) -> None:
        for pool in self._pools:
            pool.remove()
        self._pools = []
