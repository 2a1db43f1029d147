"""A step's groups dealt to data-parallel learner ranks balanced by tokens.

Every rank gets the same number of groups (a group never splits: its advantages are computed within
it), and the groups go largest first to the rank with the fewest tokens so far among those with room
(longest-processing-time first, with equal counts). The ranks then finish their forward/backward
passes at about the same time, instead of all waiting for the one that drew the long completions.
"""

from __future__ import annotations

from async_rl.protocol import TrajectoryGroup


def group_tokens(g: TrajectoryGroup) -> int:
    """Tokens the learner runs for a group: each sample's prompt and completion."""
    return len(g.prompt_tokens) * len(g.completions) + sum(len(c) for c in g.completions)


def balanced_shards(batch: list[TrajectoryGroup], world_size: int) -> list[list[TrajectoryGroup]]:
    """`world_size` shards of len(batch) // world_size groups each, balanced by `group_tokens`; each
    shard keeps the batch's order. With one rank: the batch as it is."""
    per_rank = len(batch) // world_size
    if world_size == 1:
        return [batch[:per_rank]]
    cost = [group_tokens(g) for g in batch]
    loads = [0] * world_size
    members: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(per_rank * world_size), key=lambda i: -cost[i]):
        r = min((r for r in range(world_size) if len(members[r]) < per_rank), key=lambda r: loads[r])
        members[r].append(i)
        loads[r] += cost[i]
    return [[batch[i] for i in sorted(m)] for m in members]
