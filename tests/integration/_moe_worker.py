"""Body of one MoE learner rank for test_moe_parallel (spawned: must be importable)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from async_rl.learner.driver import LearnerDriver
from tests.unit._learner_fixtures import groups, settings
from tests.unit._moe_fixtures import random_routes


def moe_shard(k: int) -> list:
    return random_routes(groups(30 + k, n_groups=2, group_size=3), 2, 2, 8, seed=30 + k, missing_every=6)


def run_rank(rank: int, world: int, master: str, model_dir: str, parallel: str, out: str) -> None:
    s = settings(model_dir, parallel=parallel, activation_checkpointing=True, routing_probe_samples=2, share_prompt=False,
                 micro_batch_size=2 + rank)  # ranks differ in micro-batch count: dummies on one of them
    learner = LearnerDriver(s, rank, world, master, [])
    learner.setup()
    metrics = [learner.train_on_shard(k, moe_shard(k)) for k in range(2)]
    learner.shutdown()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps([msgspec.to_builtins(m) for m in metrics]))
