"""Build the sender (learner rank 0) and the receivers (vLLM workers) of one broadcast membership.

The sender side is two calls, because receivers must join while the sender waits for them:
`open_membership` (non-blocking: rendezvous store, shm file) then `join_sender` (blocks until every
member is in). Receivers call `join_receiver` with the `WeightGroupInfo` the sender published.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist

from async_rl.weight_sync.base import BucketHook, WeightGroupInfo, WeightReceiver, WeightSender
from async_rl.weight_sync.bucketing import Manifest
from async_rl.weight_sync.gloo import GlooChannel, GlooGroup, host_store
from async_rl.weight_sync.shm import ShmChannel, create_region_file, new_shm_path

BACKENDS = ("gloo", "shm", "nccl", "cuda_ipc")
# Backends whose updates may be deltas: the host channels. The CUDA ones (nccl, cuda_ipc) would need
# the patches built and applied on the device, not written or verified yet (docs/weight-sync.md).
DELTA_BACKENDS = ("gloo", "shm")
# Channels whose members map one region at join: the sender waits until every receiver has.
_MAPPED = ("shm", "cuda_ipc")


def open_membership(
    host: str,
    port: int,
    world_size: int,
    timeout_s: float,
    backend: str,
    manifest: Manifest,
    checksum: str,
    generation: int,
    store: dist.TCPStore | None = None,
    delta: bool = False,
) -> tuple[WeightGroupInfo, dist.TCPStore]:
    """`delta`: updates after the membership's first may be deltas (weight_sync/delta.py)."""
    if backend not in BACKENDS:
        raise ValueError(f"weight_sync backend '{backend}' is not one of {BACKENDS}")
    if delta and backend not in DELTA_BACKENDS:
        raise ValueError(f"weight_sync.delta=on: the {backend} backend sends full updates only (delta: {DELTA_BACKENDS})")
    store = store or host_store(host, port, world_size, timeout_s)
    shm_path, nccl_id = "", b""
    if backend == "nccl":
        from async_rl.weight_sync.nccl import new_unique_id

        nccl_id = new_unique_id()
    if backend == "shm":
        shm_path = new_shm_path(f"g{generation}")
        create_region_file(shm_path, manifest)
    info = WeightGroupInfo(
        host=host,
        port=store.port,
        generation=generation,
        world_size=world_size,
        timeout_s=timeout_s,
        backend=backend,
        shm_path=shm_path,
        checksum=checksum,
        nccl_id=nccl_id,
        delta=delta,
    )
    return info, store


def _channel(info: WeightGroupInfo, group: GlooGroup, manifest: Manifest):
    largest = max(b.nbytes for b in manifest.buckets)
    if info.backend == "shm":
        return ShmChannel(group, manifest, info.shm_path)
    if info.backend == "nccl":
        from async_rl.weight_sync.nccl import NcclChannel

        return NcclChannel(info.nccl_id, group.rank, info.world_size, largest, info.timeout_s)
    if info.backend == "cuda_ipc":
        from async_rl.weight_sync.cuda_ipc import CudaIpcChannel

        return CudaIpcChannel(group, manifest)  # the region's handle goes through the group's store
    return GlooChannel(group, largest)


def join_sender(
    info: WeightGroupInfo, store: dist.TCPStore, manifest: Manifest, on_bucket: Iterable[BucketHook] = ()
) -> WeightSender:
    """Blocks until every receiver joined; then the shm file name is no longer needed. `on_bucket`:
    see `WeightSender`."""
    try:
        group = GlooGroup(
            info.host, info.port, 0, info.world_size, info.timeout_s, store=store, generation=info.generation
        )
        sender = WeightSender(
            group, _channel(info, group, manifest), manifest, info.checksum, on_bucket, delta=info.delta
        )
        if info.backend in _MAPPED:
            group.barrier()  # every receiver has mapped the file or region
    finally:
        if info.backend == "shm":
            ShmChannel.unlink(info.shm_path)  # also when the join failed: never leave it in /dev/shm
    return sender


def join_receiver(info: WeightGroupInfo, rank: int, manifest: Manifest) -> WeightReceiver:
    group = GlooGroup(info.host, info.port, rank, info.world_size, info.timeout_s, generation=info.generation)
    receiver = WeightReceiver(group, _channel(info, group, manifest), manifest, info.checksum, delta=info.delta)
    if info.backend in _MAPPED:
        group.barrier()
    return receiver
