"""The placement plan: which process gets which CPU cores. Pure logic, printed by --dry-run.

Generator engines take cores from the front, learner ranks follow; on a machine with fewer cores
than asked for, assignments wrap around and the plan says it is oversubscribed. The buffer and the
controller are light (I/O and control) and are not pinned.

On a Ray cluster (`ray.address` set) nothing is pinned: Ray places each process on whichever node
has room, and this machine's core ids mean nothing there. Each process then runs as many threads as
Ray gave it CPUs (Ray sets OMP_NUM_THREADS).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import msgspec

from async_rl.config import Config


class ProcessPlacement(msgspec.Struct, frozen=True):
    role: str
    cores: list[int]


class PlacementPlan(msgspec.Struct, frozen=True):
    num_cores: int
    engines: list[ProcessPlacement]
    learner_ranks: list[ProcessPlacement]
    oversubscribed: bool
    colocated: bool = False
    cluster: bool = False  # a Ray cluster: processes are placed by Ray and not pinned

    def render(self) -> str:
        if self.cluster:
            lines = ["placement plan (Ray cluster: nothing pinned; Ray places by CPUs and ray_resources):"]
            lines += [f"  {p.role:<18} a node Ray picks" for p in [*self.engines, *self.learner_ranks]]
            lines.append(f"  {'buffer':<18} the controller's node (its snapshot is in the run directory)")
            lines.append(f"  {'controller':<18} this process")
            return "\n".join(lines)
        note = ", OVERSUBSCRIBED" if self.oversubscribed else ""
        note += ", colocated: generators and learner alternate on the same cores" if self.colocated else ""
        lines = [f"placement plan ({self.num_cores} cores{note}):"]
        for p in [*self.engines, *self.learner_ranks]:
            lines.append(f"  {p.role:<18} cores {','.join(map(str, p.cores))}")
        lines.append(f"  {'buffer':<18} unpinned (ZMQ I/O)")
        lines.append(f"  {'controller':<18} unpinned (this process)")
        return "\n".join(lines)


def available_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def plan_placement(cfg: Config, cores: list[int] | None = None) -> PlacementPlan:
    cores = cores if cores is not None else available_cores()
    if cfg.ray.address:
        return PlacementPlan(
            num_cores=len(cores),
            engines=[ProcessPlacement(f"engine {i}", []) for i in range(cfg.generators.num_engines)],
            learner_ranks=[ProcessPlacement(f"learner rank {r}", []) for r in range(cfg.learner.world_size)],
            oversubscribed=False,
            colocated=cfg.placement == "colocated",
            cluster=True,
        )
    next_index = 0

    def take(n: int) -> list[int]:
        nonlocal next_index
        got = [cores[(next_index + i) % len(cores)] for i in range(n)]
        next_index += n
        return got

    g = cfg.generators
    colocated = cfg.placement == "colocated"
    engines = [ProcessPlacement(f"engine {i}", take(g.cpus_per_engine)) for i in range(g.num_engines)]
    if colocated:
        next_index = 0  # the learner takes the same cores; the two sides take turns
    ranks = [
        ProcessPlacement(f"learner rank {r}", take(cfg.learner.cpus_per_rank)) for r in range(cfg.learner.world_size)
    ]
    return PlacementPlan(
        num_cores=len(cores),
        engines=engines,
        learner_ranks=ranks,
        oversubscribed=next_index > len(cores),
        colocated=colocated,
    )


def pin_current_process(cores: list[int]) -> None:
    """Pin this process (and the threads it starts later) to `cores`; size torch's thread pool to match.
    No cores: not pinned, and torch keeps the thread count Ray gave the process."""
    if not cores:
        return
    if hasattr(os, "sched_setaffinity"):
        # sched_setaffinity(0) pins only the calling thread, and a Ray actor's constructor does not run
        # on the main thread: pin every thread the process has, so threads any of them start later
        # (vLLM's engine process, torch's pool, Ray's own) inherit the cores.
        tasks = Path("/proc/self/task")
        for tid in [int(t) for t in os.listdir(tasks)] if tasks.is_dir() else [0]:
            with contextlib.suppress(ProcessLookupError):  # a thread may exit meanwhile
                os.sched_setaffinity(tid, set(cores))
    try:
        import torch

        torch.set_num_threads(max(1, len(cores)))
    except ImportError:
        pass
