"""The weight-sync process boundary: one sender (learner rank 0), many receivers (vLLM workers).

A backend is a broadcast group over which the sender moves the manifest's buckets in order.
`open` is non-blocking on the sender (it returns the rendezvous port); `join` blocks until every
member is in. The manifest travels over the control plane, once per membership.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from typing import Protocol

import msgspec
import torch

from async_rl.weight_sync.bucketing import Digest, Manifest, pack, unpack


class WeightGroupInfo(msgspec.Struct, frozen=True):
    """Where and how receivers join the broadcast group; `generation` changes with membership."""

    host: str
    port: int
    generation: int
    world_size: int
    timeout_s: float


class UpdateReceipt(msgspec.Struct, frozen=True):
    version: int
    manifest_digest: str
    checksum: str  # blake2b of all bucket bytes ('' when checksums are off)
    nbytes: int
    seconds: float


class Pending(Protocol):
    def wait(self) -> object: ...


class BroadcastGroup(abc.ABC):
    """A group where rank 0 broadcasts byte buffers to every other rank."""

    @abc.abstractmethod
    def start_broadcast(self, buf: torch.Tensor) -> Pending:
        """Rank 0: start sending `buf`; other ranks: start filling `buf`. Operations run in order."""

    def broadcast(self, buf: torch.Tensor) -> None:
        self.start_broadcast(buf).wait()

    @abc.abstractmethod
    def close(self) -> None: ...


def _receipt(version: int, manifest: Manifest, digest: Digest | None, t0: float) -> UpdateReceipt:
    return UpdateReceipt(
        version=version,
        manifest_digest=manifest.digest(),
        checksum=digest.hexdigest() if digest else "",
        nbytes=manifest.total_bytes,
        seconds=time.perf_counter() - t0,
    )


def send_update(
    group: BroadcastGroup,
    manifest: Manifest,
    tensors: dict[str, torch.Tensor],
    version: int,
    checksum: bool,
) -> UpdateReceipt:
    """Pack and broadcast every bucket of `manifest` from rank 0."""
    t0 = time.perf_counter()
    digest = Digest() if checksum else None
    size = max(b.nbytes for b in manifest.buckets)
    # Double buffering: pack bucket k+1 (and checksum it) while bucket k is on the wire.
    staging = [torch.empty(size, dtype=torch.uint8) for _ in range(min(2, len(manifest.buckets)))]
    pending: Pending | None = None
    for k, bucket in enumerate(manifest.buckets):
        buf = pack(bucket, tensors, staging[k % len(staging)])
        if digest:
            digest.update(buf)
        if pending is not None:
            pending.wait()
        pending = group.start_broadcast(buf)
    if pending is not None:
        pending.wait()
    return _receipt(version, manifest, digest, t0)


def receive_update(
    group: BroadcastGroup,
    manifest: Manifest,
    version: int,
    checksum: bool,
    consume: Callable[[list[tuple[str, torch.Tensor]]], None],
) -> UpdateReceipt:
    """Receive every bucket; hand the full list of (name, tensor) to `consume` only once all arrived,
    so a failure in the middle never leaves a model with a mix of old and new weights."""
    t0 = time.perf_counter()
    digest = Digest() if checksum else None
    bufs = [torch.empty(b.nbytes, dtype=torch.uint8) for b in manifest.buckets]
    # Post every receive up front (they complete in order); checksum each as soon as it lands.
    works = [group.start_broadcast(buf) for buf in bufs]
    named: list[tuple[str, torch.Tensor]] = []
    for bucket, buf, work in zip(manifest.buckets, bufs, works, strict=True):
        work.wait()
        if digest:
            digest.update(buf)
        named.extend(unpack(bucket, buf))
    consume(named)
    return _receipt(version, manifest, digest, t0)
