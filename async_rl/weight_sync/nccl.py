"""NCCL bucket channel (CuPy) for CUDA learners and generators. Imports CuPy lazily.

Bucket bytes move GPU to GPU over a CuPy `NcclCommunicator` on a dedicated CUDA stream; the
header, trailer and membership stay on the gloo control group, so the protocol of `base` is the
same for every channel. The communicator's unique id is made by the sender and handed out by the
controller inside `WeightGroupInfo`.

UNVERIFIED on the development machines (no GPU there): see the `gpu` tests, which run on a lent
accelerator. One GPU can host only one NCCL rank, so a real broadcast needs two GPUs.
"""

from __future__ import annotations

from datetime import timedelta

import torch

from async_rl.weight_sync.base import BucketChannel, Pending


def new_unique_id() -> bytes:
    from cupy.cuda import nccl

    uid = nccl.get_unique_id()
    return bytes(uid) if not isinstance(uid, bytes) else uid  # a tuple of ints before CuPy 14


class _CudaPending:
    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def wait(self, timeout: timedelta | None = None) -> None:
        self._event.synchronize()  # a GPU stream cannot be abandoned half-way: no slices


class NcclChannel(BucketChannel):
    def __init__(self, unique_id: bytes, rank: int, world_size: int, max_bucket_bytes: int) -> None:
        from cupy.cuda import nccl

        self._nccl = nccl
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._comm = nccl.NcclCommunicator(world_size, _uid_for_cupy(unique_id), rank)
        self._stream = torch.cuda.Stream(device=self.device)
        self.max_bucket_bytes = max_bucket_bytes
        self._staging: list[torch.Tensor] = []
        # Connections are set up lazily by NCCL; a one-byte broadcast at join time moves that cost
        # out of the first update.
        self._bcast(torch.zeros(1, dtype=torch.uint8, device=self.device)).wait()

    def _bcast(self, buf: torch.Tensor) -> Pending:
        if not buf.is_cuda or not buf.is_contiguous():
            raise ValueError("NCCL buckets must be contiguous CUDA tensors")
        # The bucket was written on the current stream; the broadcast stream must see it.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._comm.bcast(buf.data_ptr(), buf.numel(), self._nccl.NCCL_UINT8, 0, self._stream.cuda_stream)
        buf.record_stream(self._stream)
        event = torch.cuda.Event()
        event.record(self._stream)
        return _CudaPending(event)

    def staging(self, k: int, nbytes: int) -> torch.Tensor:
        if not self._staging:
            self._staging = [
                torch.empty(self.max_bucket_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)
            ]
        return self._staging[k % 2][:nbytes]

    def start_send(self, k: int, buf: torch.Tensor) -> Pending:
        return self._bcast(buf)

    def post_receive(self, k: int, nbytes: int) -> tuple[torch.Tensor, Pending]:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf, self._bcast(buf)


def _uid_for_cupy(unique_id: bytes):
    """CuPy 14 takes the bytes; older CuPy a tuple of ints (signed chars)."""
    import cupy

    if int(cupy.__version__.split(".")[0]) >= 14:
        return unique_id
    return tuple(b - 256 if b > 127 else b for b in unique_id)
