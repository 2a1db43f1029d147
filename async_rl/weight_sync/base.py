"""The weight-sync process boundary: one sender (learner rank 0), many receivers (vLLM workers).

A backend is a broadcast group over which the sender moves the manifest's buckets in order.
`open` is non-blocking on the sender (it returns the rendezvous port); `join` blocks until every
member is in. The manifest travels over the control plane, once per membership.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable

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


class BroadcastGroup(abc.ABC):
    """A group where rank 0 broadcasts byte buffers to every other rank."""

    @abc.abstractmethod
    def broadcast(self, buf: torch.Tensor) -> None:
        """Rank 0: send `buf`; other ranks: fill `buf` in place."""

    @abc.abstractmethod
    def close(self) -> None: ...


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
    staging = torch.empty(max(b.nbytes for b in manifest.buckets), dtype=torch.uint8)
    for bucket in manifest.buckets:
        buf = pack(bucket, tensors, staging)
        group.broadcast(buf)
        if digest:
            digest.update(buf)
    return UpdateReceipt(
        version=version,
        manifest_digest=manifest.digest(),
        checksum=digest.hexdigest() if digest else "",
        nbytes=manifest.total_bytes,
        seconds=time.perf_counter() - t0,
    )


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
    named: list[tuple[str, torch.Tensor]] = []
    for bucket in manifest.buckets:
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
        group.broadcast(buf)
        if digest:
            digest.update(buf)
        named.extend(unpack(bucket, buf))
    consume(named)
    return UpdateReceipt(
        version=version,
        manifest_digest=manifest.digest(),
        checksum=digest.hexdigest() if digest else "",
        nbytes=manifest.total_bytes,
        seconds=time.perf_counter() - t0,
    )
