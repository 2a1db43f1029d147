"""Several torch.distributed jobs in one spawn: the same ranks run each job in turn.

A spawned rank imports torch, transformers and megatron-core before it does anything (~7 s of CPU a
process on the 2-core machine, most of a tiny model's test); a module that checks several layouts paid
that once per layout. Each job forms its own process group on its own port and destroys it (and
megatron's model-parallel state) on the way out, as every rank function here does, so the next job
starts from the same state a fresh process would, less the imports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Job = tuple[Callable[..., None], tuple[Any, ...]]  # fn(rank, *args)


def _run_jobs(rank: int, jobs: Sequence[Job]) -> None:
    for fn, args in jobs:
        fn(rank, *args)


def spawn_jobs(jobs: Sequence[Job], nprocs: int) -> None:
    """Run every job on `nprocs` spawned ranks, in order, and wait for them (a rank's error is raised here)."""
    import torch.multiprocessing as mp

    mp.spawn(_run_jobs, args=(list(jobs),), nprocs=nprocs, join=True)
