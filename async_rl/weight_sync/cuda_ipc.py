"""CUDA IPC bucket channel: colocated placement on a GPU (learner and vLLM workers on one device).

The shm channel's design with device memory: the sender allocates one CUDA region per membership
(every bucket has its own slot, so the learner's parameters can live there, see `WeightSender.adopt`),
exports its IPC handle and publishes it in the group's rendezvous store; each receiver maps it once,
at join. Per bucket only "bucket k is ready" goes over the gloo group (`RegionChannel`), after the
sender's device has finished writing it. A receiver's loader copies device to device out of the
mapping; it synchronises its device before the end-of-update barrier, after which the sender may
overwrite the slots.

The handle names the GPU by UUID, not by index: a vLLM worker and the learner may see the same
physical device under different CUDA_VISIBLE_DEVICES numbering. A receiver that cannot see the
sender's GPU fails at join with a one-line error (the channel needs `placement: colocated`).

Checksum cost: the chunks of a CUDA bucket are hashed on the device (`bucketing.device_chunk_hashes`:
a weighted word sum, exact in int64, a few kernels per 16 MiB); no bucket is copied to the host, and
the hashes themselves come over in one small copy when the update's table is built. Before, the sender
copied every bucket to the host for xxh3 (42.6 GB/s with the sampled checksum against 118 GB/s
without it, measured on an H100 on 2026-11-26); the device hash is unmeasured on a GPU so far. The
benchmark's `ours-cuda_ipc-ckoff` row measures the difference.

`close()` (a new membership, or shutdown) drops the region: the receiver's mapping is closed once the
last view of it goes; the sender's allocation is returned by `torch.cuda.ipc_collect()` once every
receiver has let go (the next membership's close collects what an earlier one could not).

UNVERIFIED on the development machines (no GPU): see tests/gpu/test_cuda_ipc_channel.py.
Imports nothing of CUDA at module level beyond torch.
"""

from __future__ import annotations

import msgspec
import torch

from async_rl.errors import RunError
from async_rl.weight_sync.base import Pending
from async_rl.weight_sync.bucketing import Manifest
from async_rl.weight_sync.gloo import GlooGroup
from async_rl.weight_sync.shm import RegionChannel, region_offsets

REGION_KEY = "cuda_ipc_region"


class CudaIpcHandle(msgspec.Struct, frozen=True):
    """What a receiver needs to map the sender's region: the tuple of torch's
    `UntypedStorage._share_cuda_()` (the arguments of `UntypedStorage._new_shared_cuda`, less the
    device index) and the GPU's UUID in place of that index."""

    device_uuid: str
    handle: bytes  # cudaIpcMemHandle_t of the allocation (block) the storage lives in
    storage_size_bytes: int
    storage_offset_bytes: int  # where the storage starts inside that block
    ref_counter_handle: bytes  # torch's shared ref-counter file (keeps the block out of reuse)
    ref_counter_offset: int
    event_handle: bytes  # cudaIpcEventHandle_t the receiver waits on before first use
    event_sync_required: bool

    def to_bytes(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def from_bytes(cls, raw: bytes) -> CudaIpcHandle:
        return msgspec.msgpack.decode(raw, type=cls)


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_device_index(uuid: str, visible: list[str]) -> int:
    """The index under which this process sees the GPU `uuid` (`visible`: UUIDs by local index)."""
    if uuid not in visible:
        raise RunError(
            f"weight_sync.backend=cuda_ipc: the sender's GPU {uuid} is not visible to this receiver "
            f"(it sees {visible or 'no GPU'}); cuda_ipc needs learner and generators on the same GPU "
            "(placement: colocated)"
        )
    return visible.index(uuid)


def new_region(nbytes: int) -> torch.Tensor:
    """Sender: the region, on the current device (where the learner's parameters are)."""
    return torch.zeros(nbytes, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))


def export_region(region: torch.Tensor) -> CudaIpcHandle:
    """Sender. The region must be a whole storage (as `new_region` makes): receivers map the storage."""
    storage = region.untyped_storage()
    if region.storage_offset() != 0 or storage.nbytes() != region.numel():
        raise ValueError("export_region needs a tensor that is its whole storage")
    # torch re-points the storage at a ref-counted block here; the data pointer does not change.
    (index, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = storage._share_cuda_()
    return CudaIpcHandle(
        device_uuid=device_uuid(index),
        handle=handle,
        storage_size_bytes=size,
        storage_offset_bytes=offset,
        ref_counter_handle=ref_handle,
        ref_counter_offset=ref_offset,
        event_handle=event_handle,
        event_sync_required=event_sync,
    )


def open_region(h: CudaIpcHandle) -> torch.Tensor:
    """Receiver: map the sender's region (once per membership); a uint8 tensor on this GPU."""
    torch.cuda.init()
    index = local_device_index(h.device_uuid, [device_uuid(i) for i in range(torch.cuda.device_count())])
    storage = torch.UntypedStorage._new_shared_cuda(
        index,
        h.handle,
        h.storage_size_bytes,
        h.storage_offset_bytes,
        h.ref_counter_handle,
        h.ref_counter_offset,
        h.event_handle,
        h.event_sync_required,
    )
    return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index)).set_(storage)


def loader_device() -> torch.device:
    """The device this process's loader copies into (a vLLM worker's current device)."""
    return torch.device("cuda", torch.cuda.current_device())


def synchronize(device: torch.device) -> None:
    torch.cuda.synchronize(device)


def collect_exported() -> None:
    """Sender: free the exported blocks that no receiver maps any more (torch keeps them until asked)."""
    torch.cuda.ipc_collect()


class CudaIpcChannel(RegionChannel):
    kind = "CUDA IPC"

    def __init__(self, group: GlooGroup, manifest: Manifest) -> None:
        size = region_offsets(manifest)[-1]
        if group.rank == 0:
            region = new_region(size)
            group.publish(REGION_KEY, export_region(region).to_bytes())
        else:
            handle = CudaIpcHandle.from_bytes(group.fetch(REGION_KEY))
            if handle.storage_size_bytes != size:
                raise RunError(
                    f"weight_sync cuda_ipc: the sender's region has {handle.storage_size_bytes} bytes, this "
                    f"receiver's manifest needs {size} (sender and receivers disagree on the model)"
                )
            region = open_region(handle)
        super().__init__(group, manifest, region)
        self.device = region.device

    def start_send(self, k: int, buf: torch.Tensor) -> Pending:
        # The bucket was written by kernels (packing, or the optimizer for resident parameters) that
        # may still be running: receivers read it as soon as they get the signal, from other
        # processes, which no stream of ours orders. Every stream of the device, not only the
        # current one: a learner may write its parameters from side streams.
        synchronize(self.device)
        return super().start_send(k, buf)

    def close(self) -> None:
        if self.region.numel() == 0:
            return  # closed already
        synchronize(self.device)  # no copy of ours still reads or writes the region
        super().close()
        if self.group.rank == 0:
            collect_exported()

    def finish_receive(self) -> None:
        # The loader's copies out of the mapping are asynchronous; once this receiver passes the end
        # barrier the sender may write the next update into the same slots. They were queued on the
        # loader's device (the worker's, where its parameters live); when the mapping is on another
        # GPU a peer copy involves that one too: synchronize both (one call when they are the same).
        for device in dict.fromkeys([loader_device(), self.device]):
            synchronize(device)
