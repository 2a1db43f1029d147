"""Body of one data-parallel LoRA learner rank for test_lora_data_parallel (spawned: must be importable)."""

from __future__ import annotations

from pathlib import Path

import torch

from async_rl.config import LoraConfig
from async_rl.learner.driver import LearnerDriver
from tests.unit._learner_fixtures import groups, settings


def run_rank(rank: int, world: int, master: str, model_dir: str, out: str, parallel: str) -> None:
    s = settings(model_dir, parallel=parallel, lora=LoraConfig(enabled=True, rank=4, alpha=8.0))
    learner = LearnerDriver(s, rank, world, master, [])
    learner.setup()
    for k in range(2):
        learner.train_on_shard(k, groups(20 + k + 10 * rank))  # each rank its own shard
    learner.gather_weights()
    if rank == 0:
        adapter = learner.backend.adapter()
        torch.save({n: t.detach().clone().cpu() for n, t in adapter.tensors.items()}, Path(out) / f"{parallel}.pt")
    if parallel == "ddp":  # every replica holds the same adapter (gradients were averaged)
        ours = {n: t.detach().clone() for n, t in learner.backend.adapter().tensors.items()}
        torch.save(ours, Path(out) / f"ddp_rank{rank}.pt")
    learner.shutdown()
