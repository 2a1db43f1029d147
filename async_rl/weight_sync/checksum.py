"""Order-independent checksum of a set of parameters (float64 sum, sum of squares, count).

Invariant under fusing (q,k,v -> qkv), reordering and repacking of the same elements, so it can
compare a learner's HF parameters with a vLLM model's loaded parameters.
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
