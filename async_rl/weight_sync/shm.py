"""Shared-memory bucket channel for receivers on the sender's host.

The sender packs every bucket into one file in /dev/shm that each receiver maps; the gloo group
carries only a bucket index per bucket ("bucket k is ready"). A receiver's loader then copies
straight out of the mapping: one copy on each side and no socket in the data path. The file is
unlinked as soon as every receiver has mapped it, so nothing is left behind if a process dies.

`RegionChannel` is that signalling over any region every member sees; `cuda_ipc` reuses it with a
CUDA allocation in place of the file.
"""

from __future__ import annotations

import os
import uuid

import torch

from async_rl.weight_sync.base import BroadcastGroup, BucketChannel, CorruptUpdate, Pending
from async_rl.weight_sync.bucketing import Manifest

SHM_DIR = "/dev/shm"


def new_shm_path(tag: str) -> str:
    return os.path.join(SHM_DIR, f"async_rl-{tag}-{uuid.uuid4().hex[:12]}")


def region_offsets(manifest: Manifest) -> list[int]:
    """Start of every bucket's slot in the region (64-byte aligned), then the region's size."""
    offsets, total = [], 0
    for b in manifest.buckets:
        offsets.append(total)
        total += -(-b.nbytes // 64) * 64
    return offsets + [total]


def create_region_file(path: str, manifest: Manifest) -> None:
    """Sender: the file every member maps. Its pages are allocated now, at membership time, so the
    first update does not pay for allocating gigabytes of shared memory page by page."""
    with open(path, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, region_offsets(manifest)[-1])


class RegionChannel(BucketChannel):
    """Every bucket has its own slot in one region that all members see for the whole membership;
    per bucket only its index goes over the group, as the "bucket k is ready" signal."""

    kind = "shared-memory"  # names the region in errors

    def __init__(self, group: BroadcastGroup, manifest: Manifest, region: torch.Tensor) -> None:
        self.group = group
        self._offsets = region_offsets(manifest)
        if region.numel() < self._offsets[-1]:
            raise ValueError(f"weight region of {region.numel()} bytes, the manifest needs {self._offsets[-1]}")
        self.region = region
        self._signals: list[torch.Tensor] = []

    def _slot(self, k: int, nbytes: int) -> torch.Tensor:
        if self.region.numel() < self._offsets[-1]:
            raise RuntimeError(f"the {self.kind} weight channel was closed (its membership is over)")
        return self.region[self._offsets[k] : self._offsets[k] + nbytes]

    def close(self) -> None:
        """Drop this member's reference to the region (the file mapping, or the CUDA allocation or
        its IPC mapping): it is freed once nothing else holds it. Tensors a sender adopted into the
        region are views of it and keep it alive until they move (into the next membership's region)."""
        self.region = self.region.new_empty(0)
        self._signals = []

    def staging(self, k: int, nbytes: int) -> torch.Tensor:
        return self._slot(k, nbytes)

    def resident_slot(self, k: int, nbytes: int) -> torch.Tensor:
        return self._slot(k, nbytes)  # every bucket has its own slot for the whole membership

    def start_send(self, k: int, buf: torch.Tensor) -> Pending:
        return self.group.start_broadcast(torch.tensor([k], dtype=torch.int64))

    def post_receive(self, k: int, nbytes: int) -> tuple[torch.Tensor, Pending]:
        if k == 0:
            self._signals = []
        signal = torch.full((1,), -1, dtype=torch.int64)
        self._signals.append(signal)
        return self._slot(k, nbytes), self.group.start_broadcast(signal)

    def check(self, k: int) -> None:
        if int(self._signals[k]) != k:
            raise CorruptUpdate(f"{self.kind} update out of order: bucket {int(self._signals[k])} announced as {k}")


class ShmChannel(RegionChannel):
    def __init__(self, group: BroadcastGroup, manifest: Manifest, path: str) -> None:
        size = region_offsets(manifest)[-1]
        super().__init__(group, manifest, torch.from_file(path, shared=True, size=size, dtype=torch.uint8))
        self.path = path
        # Fault every page into this process now, at membership time, not inside the first update
        # (~1 us per 4 KiB page: a quarter second per GB). The sender writes, receivers only read.
        pages = self.region[:: os.sysconf("SC_PAGE_SIZE")]
        if group.rank == 0:
            pages.zero_()
        else:
            int(pages.sum())

    @staticmethod
    def unlink(path: str) -> None:
        """Sender, once every receiver mapped the file: the mappings outlive the name."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
