"""Host reads counted on the CPU as a proxy for CUDA syncs (test_learner_syncs.py, the megatron
attention ranks): every Python-level read of a tensor's values (item, tolist, float, int, bool, numpy;
nested reads count once) and every op with a data-dependent shape (nonzero, masked_select). Reads of
host tensors count too (they cost no sync on a GPU): tests bound the count's growth per micro-batch."""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "numpy")


class HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self._depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._depth == 0 and func.overloadpacket.__name__ in ("nonzero", "masked_select"):
            self.count += 1
        return func(*args, **(kwargs or {}))

    def _counted(self, real):
        def read(t, *args, **kwargs):
            self.count += self._depth == 0
            self._depth += 1
            try:
                return real(t, *args, **kwargs)
            finally:
                self._depth -= 1

        return read

    @contextlib.contextmanager
    def counting(self):
        saved = {name: getattr(torch.Tensor, name) for name in READS}
        try:
            for name, real in saved.items():
                setattr(torch.Tensor, name, self._counted(real))
            with self:
                yield self
        finally:
            for name, real in saved.items():
                setattr(torch.Tensor, name, real)
