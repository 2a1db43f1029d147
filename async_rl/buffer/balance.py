"""A step's groups dealt to data-parallel learner ranks balanced by their learner FLOPs.

Every rank gets the same number of groups (a group never splits: its advantages are computed within
it), and the groups go largest first to the rank with the least cost so far among those with room
(longest-processing-time first, with equal counts). The ranks then finish their forward/backward
passes at about the same time, instead of all waiting for the one that drew the long completions.

A group's cost is its tokens plus attention's quadratic share (`models.shape.sequence_cost`): a
sequence of L tokens costs `L + attention_weight x L^2 / 2`. With the weight 0 that is tokens alone;
for Qwen2.5-0.5B's shape the weight is 8.7e-5, so long sequences (8k tokens: +36%) weigh more than
their tokens, short ones (712: +3%) about the same. Micro-batches within a rank need no such weight:
they run one after another, so the rank's time is their sum however they are cut (their cut is set
by memory, tokens: `learner.packing.balanced`).
"""

from __future__ import annotations

from async_rl.models.shape import sequence_cost
from async_rl.protocol import TrajectoryGroup


def group_cost(g: TrajectoryGroup, attention_weight: float) -> float:
    """A group's learner FLOPs in units of one token's matmuls: each sample's prompt and completion
    as one sequence (`sequence_cost`). With `attention_weight` 0: the tokens the learner runs."""
    prompt = len(g.prompt_tokens)
    return sum(sequence_cost(prompt + len(c), attention_weight) for c in g.completions)


def balanced_shards(
    batch: list[TrajectoryGroup], world_size: int, attention_weight: float = 0.0
) -> list[list[TrajectoryGroup]]:
    """`world_size` shards of len(batch) // world_size groups each, balanced by `group_cost`; each
    shard keeps the batch's order. With one rank: the batch as it is."""
    per_rank = len(batch) // world_size
    if world_size == 1:
        return [batch[:per_rank]]
    cost = [group_cost(g, attention_weight) for g in batch]
    loads = [0.0] * world_size
    members: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(per_rank * world_size), key=lambda i: -cost[i]):
        r = min((r for r in range(world_size) if len(members[r]) < per_rank), key=lambda r: loads[r])
        members[r].append(i)
        loads[r] += cost[i]
    return [[batch[i] for i in sorted(m)] for m in members]
