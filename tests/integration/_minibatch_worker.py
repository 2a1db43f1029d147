"""Body of one learner rank for test_learner_minibatches (spawned: must be importable)."""

from __future__ import annotations

from pathlib import Path

import torch

from async_rl.learner.driver import LearnerDriver
from tests.unit._learner_fixtures import groups, settings


def shard(rank: int) -> list:
    """Two groups per rank, of different token counts on the two ranks."""
    return groups(40 + rank, n_groups=2)


def make_learner(model_dir: str, rank: int, world: int, master: str) -> LearnerDriver:
    learner = LearnerDriver(settings(model_dir, minibatches=2, epochs=2, max_nonfinite_steps=0), rank, world, master, [])
    learner.setup()
    return learner


def weights(learner: LearnerDriver) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.backend.model.named_parameters()}


def run_rank(rank: int, world: int, master: str, model_dir: str, out: str) -> None:
    learner = make_learner(model_dir, rank, world, master)
    m = learner.train_on_shard(0, shard(rank))
    norms = [u.grad_norm for u in learner.last_updates]
    trained = weights(learner)
    # A NaN in rank 1's gradient only (after DDP's reduction): both ranks skip every update of the
    # next batch, though rank 0's own gradient is finite (max_nonfinite_steps=0: the run goes on).
    forward_backward = learner.backend.forward_backward

    def poisoned(*args, **kwargs):
        forward_backward(*args, **kwargs)
        if rank == 1:
            next(learner.backend.model.parameters()).grad.view(-1)[0] = float("nan")

    learner.backend.forward_backward = poisoned
    skipped = learner.train_on_shard(1, shard(rank))
    torch.save(
        {"metrics": m, "norms": norms, "trained": trained, "skipped": skipped, "after_skip": weights(learner)},
        Path(out) / f"rank{rank}.pt",
    )
    learner.shutdown()
