"""Body of one learner rank for test_learner_token_mean (spawned: must be importable)."""

from __future__ import annotations

from pathlib import Path

import torch

from async_rl.learner.driver import LearnerDriver
from tests.unit._learner_fixtures import groups, settings


def shard(rank: int) -> list:
    """Rank 0 gets one group, rank 1 three: unequal token counts (completions of 1-6 tokens)."""
    return groups(30, n_groups=1) if rank == 0 else groups(31, n_groups=3)


def make_learner(model_dir: str, rank: int, world: int, master: str):
    learner = LearnerDriver(settings(model_dir, max_grad_norm=1e9), rank, world, master, [])
    learner.setup()
    return learner


def gradients(learner) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in learner.backend.model.named_parameters() if p.grad is not None}


def run_rank(rank: int, world: int, master: str, model_dir: str, out: str) -> None:
    learner = make_learner(model_dir, rank, world, master)
    learner.train_on_shard(0, shard(rank))
    if rank == 0:
        torch.save(gradients(learner), Path(out) / "grads.pt")
    learner.shutdown()
