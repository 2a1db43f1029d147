"""Order-independent checksum of a set of parameters (float64 sum, sum of squares, count).

Invariant under fusing (q,k,v -> qkv), reordering and repacking of the same elements, so it can
compare a learner's HF parameters with a vLLM model's loaded parameters. Every field is a sum, so
the checksums of an engine's tensor-parallel shards add up to the whole model's (`engine_checksum`).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
import torch


class ParamChecksum(msgspec.Struct, frozen=True):
    total: float
    sum_sq: float
    count: int

    def close_to(self, other: ParamChecksum, rtol: float = 1e-9) -> bool:
        scale = max(1.0, abs(self.sum_sq))
        return (
            self.count == other.count
            and abs(self.total - other.total) <= rtol * scale
            and abs(self.sum_sq - other.sum_sq) <= rtol * scale
        )


def checksum_of(tensors: Iterable[torch.Tensor]) -> ParamChecksum:
    total = 0.0
    sum_sq = 0.0
    count = 0
    with torch.no_grad():
        for t in tensors:
            t64 = t.detach().to(torch.float64)
            total += float(t64.sum())
            sum_sq += float((t64 * t64).sum())
            count += t.numel()
    return ParamChecksum(total=total, sum_sq=sum_sq, count=count)


def add(parts: Iterable[ParamChecksum]) -> ParamChecksum:
    """The checksum of the union of disjoint sets (every field is a sum)."""
    parts = list(parts)
    return ParamChecksum(
        total=sum(p.total for p in parts), sum_sq=sum(p.sum_sq for p in parts), count=sum(p.count for p in parts)
    )


class ShardChecksum(msgspec.Struct, frozen=True):
    """What one tensor-parallel worker of an engine computes with, split in two: `sharded`, the
    slices that are this worker's own (summed over the engine's workers they make each sharded
    weight once), and `replicated`, the weights every worker holds whole (counted once)."""

    sharded: ParamChecksum
    replicated: ParamChecksum


def engine_checksum(workers: list[ShardChecksum]) -> ParamChecksum:
    """The checksum of the whole model an engine computes with, from its TP workers' parts: comparable
    with the learner's (`checksum_of` its full HF weights). Raises ValueError when the workers'
    replicated weights differ (a worker holding other weights than its peers)."""
    if not workers:
        raise ValueError("an engine without workers has no checksum")
    first = workers[0].replicated
    for rank, w in enumerate(workers[1:], start=1):
        if not w.replicated.close_to(first):
            raise ValueError(f"TP worker {rank} holds other replicated weights than worker 0")
    return add([*(w.sharded for w in workers), first])
