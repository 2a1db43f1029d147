"""The megatron backend's batch: a padded shard with GRPO advantages (the other algorithms of
`learner/rl/algorithms.py` run on the torch backend only so far)."""

from __future__ import annotations

from async_rl.learner.batch.padded import PaddedShard
from async_rl.learner.rl.advantages import grpo_advantages
from async_rl.protocol import TrajectoryGroup


class Collated(PaddedShard):
    def __init__(self, groups: list[TrajectoryGroup]) -> None:
        super().__init__(groups)
        # per episode, then to each of its rows (a split agent episode's segments share it)
        self.advantages = grpo_advantages(self.rewards).reshape(-1)[self.episode_rows].reshape(-1, 1)
