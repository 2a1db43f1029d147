"""A step's groups dealt to data-parallel learner ranks balanced by their estimated learner cost.

Every rank gets the same number of groups (a group never splits: its advantages are computed within
it), and the groups go largest first to the rank with the least cost so far among those with room
(longest-processing-time first, with equal counts). The ranks then finish their forward/backward
passes at about the same time, instead of all waiting for the one that drew the long completions.

A group's cost is the sum of its samples' (`models.cost.CostModel.sample`: tokens plus the attention
pairs the learner's attention path computes, weighted by the model's shape). The learner sends its
cost model with its batch request, so the dealing follows the kernel that will run: on CUDA's varlen
flash attention a sequence of L tokens costs `L + w L^2 / 2`; on the CPU's SDPA a sample sharing a
packed row pays for the row's whole width. With the default `CostModel()` (weight 0): tokens alone.
"""

from __future__ import annotations

from async_rl.models.cost import TOKENS, CostModel, deal
from async_rl.protocol import TrajectoryGroup


def group_cost(g: TrajectoryGroup, cost: CostModel = TOKENS) -> float:
    """A group's estimated learner cost: each sample's prompt and completion as one sequence."""
    prompt = len(g.prompt_tokens)
    return sum(cost.sample(prompt + len(c)) for c in g.completions)


def balanced_shards(batch: list[TrajectoryGroup], world_size: int, cost: CostModel = TOKENS) -> list[list[TrajectoryGroup]]:
    """`world_size` shards of len(batch) // world_size groups each, balanced by `group_cost`; each
    shard keeps the batch's order. With one rank: the batch as it is."""
    per_rank = len(batch) // world_size
    if world_size == 1:
        return [batch[:per_rank]]
    dealt = batch[: per_rank * world_size]
    owner = deal([group_cost(g, cost) for g in dealt], world_size, per_rank)
    return [[g for g, o in zip(dealt, owner, strict=True) if o == r] for r in range(world_size)]
