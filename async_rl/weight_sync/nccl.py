"""NCCL bucket channel (CuPy) for CUDA learners and generators. Imports CuPy lazily.

Bucket bytes move GPU to GPU over a CuPy `NcclCommunicator` on a dedicated CUDA stream; the
header, trailer and membership stay on the gloo control group, so the protocol of `base` is the
same for every channel. The communicator's unique id is made by the sender and handed out by the
controller inside `WeightGroupInfo`.

Why CuPy (the `gpu` extra installs `cupy-cuda13x`, the CUDA major of torch 2.13, which vLLM 0.32
pins; CuPy then loads the same `nvidia-nccl-cu13` libnccl torch does): the binding must work in a
learner rank without vLLM (a Megatron box, the GPU tests' part A), it exposes exactly the calls this
channel needs (unique id, init, bcast on our stream, abort, async-error query), and its API has not
moved in years. vLLM's `PyNcclCommunicator` (what `weight_transfer/nccl_engine.py` builds on) binds
torch's own libnccl, but it is vLLM-internal and moves between releases, and its engine brings its
own wire protocol (no manifest digest, no checksums). torch's `ProcessGroupNCCL` would need a
second NCCL process group inside vLLM's workers, and its watchdog tears the process down on a
timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING), where we want one abandoned update, not a dead engine.

Failure: a dead member leaves the others' NCCL kernels spinning for ever, so an operation is never
waited on with `synchronize()`: `_CudaPending` polls its event in slices (between them the gloo
group looks for the abort the controller or another member set) up to `weight_sync.timeout_s`, and
an abandoned membership aborts the communicator (`ncclCommAbort`: the kernels stop, the memory is
freed). A new membership closes the old channel the same way, so no communicator outlives it.

Memory: the communicator is made at join, after vLLM sized its KV cache from
`generators.gpu_memory_utilization`. Its memory (NCCL's buffers, `NCCL_RESERVE_BYTES`, plus this
channel's in-flight buckets) comes out of the headroom that fraction leaves; `check_headroom` makes
a GPU without it fail at join with one line naming the fields, instead of running out of memory
in the middle of an update.

UNVERIFIED on the development machines (no GPU there): see the `gpu` tests, which run on a lent
accelerator. One GPU can host only one NCCL rank, so a real broadcast needs two GPUs.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch

from async_rl.errors import RunError
from async_rl.weight_sync.base import RECEIVE_WINDOW, BucketChannel, Pending
from async_rl.weight_sync.gloo import SLICE_TIMED_OUT  # a slice that ran out, as GlooGroup.wait reads it

POLL_S = 0.0005  # how often a waiting member queries its broadcast's event
# NCCL's own device memory for a broadcast ring: per channel and peer, its protocol buffers (Simple
# 4 MiB, LL128 ~4.5 MiB, LL 256 KiB), up to 32 channels on NVLink and 2 peers, with some margin.
NCCL_RESERVE_BYTES = 768 << 20


def new_unique_id() -> bytes:
    from cupy.cuda import nccl

    return unique_id_bytes(nccl.get_unique_id())


def unique_id_bytes(uid: bytes | tuple[int, ...]) -> bytes:
    """CuPy 14 gives bytes; older CuPy a tuple of 128 signed chars, which `bytes()` refuses (< 0)."""
    return uid if isinstance(uid, bytes) else bytes(b & 0xFF for b in uid)


def unique_id_for_cupy(unique_id: bytes, cupy_major: int) -> bytes | tuple[int, ...]:
    """CuPy 14 takes the bytes; older CuPy a tuple of signed chars."""
    if cupy_major >= 14:
        return unique_id
    return tuple(b - 256 if b > 127 else b for b in unique_id)


def channel_bytes(rank: int, max_bucket_bytes: int) -> tuple[int, int]:
    """(NCCL's buffers, this member's buckets in flight): two staging buckets on the sender; on a
    receiver the posted window plus the one its loader is reading."""
    buckets = 2 if rank == 0 else RECEIVE_WINDOW + 1
    return NCCL_RESERVE_BYTES, buckets * max_bucket_bytes


def check_headroom(free_bytes: int, cached_bytes: int, rank: int, max_bucket_bytes: int, where: str) -> None:
    """Raise a one-line RunError when this GPU cannot hold the channel. `free_bytes`: the driver's free
    memory; `cached_bytes`: torch's cached but unused blocks (buckets may reuse them, NCCL may not)."""
    nccl_bytes, bucket_bytes = channel_bytes(rank, max_bucket_bytes)
    if free_bytes >= nccl_bytes and free_bytes + cached_bytes >= nccl_bytes + bucket_bytes:
        return
    mib = 1 << 20
    raise RunError(
        f"weight_sync.backend=nccl: {where} has {free_bytes // mib} MiB free, the channel needs "
        f"{(nccl_bytes + bucket_bytes) // mib} MiB (NCCL {nccl_bytes // mib} MiB + buckets of "
        f"weight_sync.bucket_mb in flight); lower generators.gpu_memory_utilization or weight_sync.bucket_mb"
    )


class _CudaPending:
    """A broadcast in flight on the channel's stream, polled (never `synchronize()`, which a dead peer
    would block for ever): `wait(slice)` returns when it is done, raises RuntimeError('Operation timed
    out') when the slice ran out (the operation goes on, as c10d's Work does), and past the deadline
    aborts the communicator and raises."""

    def __init__(self, event, channel: NcclChannel, deadline: float, timeout_s: float) -> None:
        self._event = event
        self._channel = channel
        self._deadline = deadline
        self._timeout_s = timeout_s

    def wait(self, timeout: timedelta | None = None) -> None:
        until = None if timeout is None else time.monotonic() + timeout.total_seconds()
        while not self._event.query():
            self._channel.check_async_error()  # NCCL itself saw a peer go (e.g. its socket closed)
            now = time.monotonic()
            if now >= self._deadline:
                self._channel.abandon()
                raise RuntimeError(
                    f"NCCL broadcast not done within weight_sync.timeout_s={self._timeout_s:.0f}s: communicator aborted"
                )
            if until is not None and now >= until:
                raise RuntimeError(SLICE_TIMED_OUT)
            time.sleep(POLL_S)


class NcclChannel(BucketChannel):
    def __init__(self, unique_id: bytes, rank: int, world_size: int, max_bucket_bytes: int, timeout_s: float) -> None:
        import cupy
        from cupy.cuda import nccl

        self._nccl = nccl
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = timeout_s
        self.max_bucket_bytes = max_bucket_bytes
        free, _ = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        check_headroom(free, cached, rank, max_bucket_bytes, f"GPU {self.device.index} of NCCL rank {rank}")
        major = int(cupy.__version__.split(".")[0])
        self._comm = nccl.NcclCommunicator(world_size, unique_id_for_cupy(unique_id, major), rank)
        self._stream = torch.cuda.Stream(device=self.device)
        self._staging: list[torch.Tensor] = []
        # Connections are set up lazily by NCCL; a one-byte broadcast at join time moves that cost
        # out of the first update.
        self._bcast(torch.zeros(1, dtype=torch.uint8, device=self.device)).wait()

    def _bcast(self, buf: torch.Tensor) -> Pending:
        if self._comm is None:
            raise RuntimeError("NCCL channel used after its membership was abandoned")
        if not buf.is_cuda or not buf.is_contiguous():
            raise ValueError("NCCL buckets must be contiguous CUDA tensors")
        # The bucket was written on the current stream; the broadcast stream must see it.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._comm.bcast(buf.data_ptr(), buf.numel(), self._nccl.NCCL_UINT8, 0, self._stream.cuda_stream)
        buf.record_stream(self._stream)
        event = torch.cuda.Event()
        event.record(self._stream)
        return _CudaPending(event, self, time.monotonic() + self.timeout_s, self.timeout_s)

    def check_async_error(self) -> None:
        """Raise if NCCL recorded an asynchronous error on the communicator (a peer's connection broke)."""
        check = getattr(self._comm, "check_async_error", None)  # CuPy >= 8
        if check is not None:
            check()

    def abandon(self) -> None:
        """Abort the communicator: its kernels still waiting for a dead peer stop, its memory is freed.
        ncclCommAbort never waits for the other members (ncclCommDestroy would, for pending work)."""
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.abort()

    def close(self) -> None:
        # Aborting a communicator with nothing in flight just frees it (vLLM's PyNccl does the same).
        self.abandon()
        self._staging = []

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
