"""The NCCL channel's logic without a GPU: its wait polls with a deadline and aborts the communicator
(never an unbounded synchronize), a membership given up mid-update aborts it, a new membership closes
the old one's, the headroom check at join, and CuPy's unique-id forms. A fake communicator and a fake
CUDA event stand in for CuPy and the stream; the gloo group around them is real."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

from async_rl.config import WeightSyncConfig
from async_rl.errors import RunError
from async_rl.learner.weight_source import WeightSource
from async_rl.weight_sync import nccl
from async_rl.weight_sync.base import SyncAborted, WeightSender
from async_rl.weight_sync.bucketing import build_manifest
from async_rl.weight_sync.gloo import SLICE_TIMED_OUT, GlooGroup, host_store


class NeverDone:
    """A CUDA event whose broadcast never completes (a peer died before its part)."""

    def query(self) -> bool:
        return False


class FakeComm:
    def __init__(self, async_error: Exception | None = None) -> None:
        self.aborted = 0
        self.async_error = async_error

    def abort(self) -> None:
        self.aborted += 1

    def check_async_error(self) -> None:
        if self.async_error is not None:
            raise self.async_error


class HungChannel(nccl.NcclChannel):
    """NcclChannel with its communicator faked: every broadcast hangs, as with a dead peer. Buckets stay
    on the CPU (packing is the same code)."""

    def __init__(self, comm: FakeComm, timeout_s: float, max_bucket_bytes: int = 1 << 16) -> None:
        self._comm = comm
        self.timeout_s = timeout_s
        self.max_bucket_bytes = max_bucket_bytes
        self._staging = []
        self.device = torch.device("cpu")

    def staging(self, k: int, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def _bcast(self, buf: torch.Tensor):
        if self._comm is None:
            raise RuntimeError("NCCL channel used after its membership was abandoned")
        return nccl._CudaPending(NeverDone(), self, time.monotonic() + self.timeout_s, self.timeout_s)


def test_wait_slice_runs_out_as_c10d_says_and_leaves_the_operation_alone():
    comm = FakeComm()
    pending = HungChannel(comm, timeout_s=60)._bcast(torch.empty(1, dtype=torch.uint8))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=SLICE_TIMED_OUT):
        pending.wait(timedelta(seconds=0.05))
    assert time.monotonic() - t0 < 1.0
    assert comm.aborted == 0  # only a slice: the caller looks for an abort and waits again


def test_wait_past_the_deadline_aborts_the_communicator():
    comm = FakeComm()
    pending = HungChannel(comm, timeout_s=0.3)._bcast(torch.empty(1, dtype=torch.uint8))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="weight_sync.timeout_s") as info:
        pending.wait()  # no slice: bounded by the deadline all the same
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert SLICE_TIMED_OUT not in str(info.value)  # a failure, not a slice
    assert comm.aborted == 1


def test_nccl_async_error_ends_the_wait():
    comm = FakeComm(async_error=RuntimeError("NCCL_ERROR_REMOTE_ERROR: peer gone"))
    pending = HungChannel(comm, timeout_s=60)._bcast(torch.empty(1, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="peer gone"):
        pending.wait(timedelta(seconds=5))


def test_close_aborts_the_communicator_once_and_the_channel_refuses_further_use():
    comm = FakeComm()
    ch = HungChannel(comm, timeout_s=60)
    ch.close()
    ch.close()
    ch.abandon()
    assert comm.aborted == 1
    with pytest.raises(RuntimeError, match="abandoned"):
        ch.start_send(0, torch.empty(1, dtype=torch.uint8))


@pytest.fixture
def solo_group():
    """A real gloo control group with the sender alone in it (world size 1)."""
    store = host_store("127.0.0.1", 0, 1, 30)
    group = GlooGroup("127.0.0.1", store.port, 0, 1, 30, store=store, generation=1)
    yield group
    group.close()


def sender_over(group: GlooGroup, channel: HungChannel) -> tuple[WeightSender, dict[str, torch.Tensor]]:
    state = {"a": torch.randn(64, 8), "b": torch.randn(64, 8)}
    manifest = build_manifest(state.items(), bucket_bytes=2048)
    return WeightSender(group, channel, manifest, "off"), state


def test_an_abort_while_a_bucket_hangs_ends_the_send_in_well_under_a_second(solo_group):
    """The controller saw an engine die and set the group's abort: the sender, stuck on an NCCL
    broadcast that will never finish, gives up at its next slice and aborts the communicator."""
    comm = FakeComm()
    sender, state = sender_over(solo_group, HungChannel(comm, timeout_s=600))
    timer = threading.Timer(0.3, solo_group.abort, args=("controller: engine 3 died",))
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(SyncAborted, match="engine 3 died"):
            sender.send(state, version=1)
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 2.0
    assert comm.aborted == 1  # the hung kernel is stopped, not left for the garbage collector


def test_a_broadcast_past_its_timeout_abandons_the_membership(solo_group):
    comm = FakeComm()
    sender, state = sender_over(solo_group, HungChannel(comm, timeout_s=0.4))
    t0 = time.monotonic()
    with pytest.raises(SyncAborted, match="weight_sync.timeout_s"):
        sender.send(state, version=1)
    assert time.monotonic() - t0 < 3.0
    assert comm.aborted == 1


def test_sender_close_releases_channel_and_group(solo_group):
    comm = FakeComm()
    sender, _ = sender_over(solo_group, HungChannel(comm, timeout_s=60))
    sender.close()
    assert comm.aborted == 1 and solo_group._pg is None


def test_a_new_membership_closes_the_old_ones_channel(monkeypatch):
    """One communicator per membership: WeightSource.open (a membership change) closes the previous
    sender's channel, and so does the source's close."""
    closed: list[int] = []
    source = WeightSource(WeightSyncConfig(backend="gloo", bucket_mb=1, timeout_s=30), lambda: {"w": torch.zeros(4)})
    try:
        for generation in (1, 2):
            source.open(world_size=1)
            source.join()
            monkeypatch.setattr(source._sender.channel, "close", lambda g=generation: closed.append(g))
            assert closed == list(range(1, generation))
    finally:
        source.close()
    assert closed == [1, 2]


def test_a_worker_rejoining_closes_its_old_receiver(monkeypatch):
    import msgspec

    from async_rl.serving import worker_extension as ext
    from async_rl.weight_sync.base import WeightGroupInfo
    from async_rl.weight_sync.bucketing import Manifest

    class OldReceiver:
        closed = False

        def close(self):
            OldReceiver.closed = True

    new = object()
    monkeypatch.setattr(ext, "_die_with_parent", lambda: None)
    monkeypatch.setattr(ext, "join_receiver", lambda info, rank, manifest: new)
    worker = ext.WeightReceiverExtension()
    worker.rank = 0
    worker._async_rl_receiver = OldReceiver()
    info = WeightGroupInfo(host="127.0.0.1", port=1, generation=2, world_size=2, timeout_s=5, backend="nccl")
    worker.async_rl_join_weight_group(msgspec.msgpack.encode(info), 1, msgspec.msgpack.encode(Manifest(buckets=[])))
    assert OldReceiver.closed and worker._async_rl_receiver is new


def test_headroom_check_fails_at_join_in_one_line_naming_the_fields():
    gib, mib = 1 << 30, 1 << 20
    nccl.check_headroom(8 * gib, 0, rank=1, max_bucket_bytes=64 * mib, where="GPU 0")  # plenty
    with pytest.raises(RunError) as info:
        nccl.check_headroom(300 * mib, 0, rank=1, max_bucket_bytes=64 * mib, where="GPU 3 of NCCL rank 2")
    msg = str(info.value)
    assert "\n" not in msg
    assert "GPU 3" in msg and "generators.gpu_memory_utilization" in msg and "weight_sync.bucket_mb" in msg


def test_headroom_counts_torch_cache_for_buckets_but_not_for_nccl():
    mib = 1 << 20
    nccl_bytes, buckets = nccl.channel_bytes(rank=1, max_bucket_bytes=64 * mib)
    assert buckets == 3 * 64 * mib  # the posted window plus the bucket being loaded
    nccl.check_headroom(nccl_bytes, buckets, rank=1, max_bucket_bytes=64 * mib, where="GPU 0")
    with pytest.raises(RunError):  # torch's cached blocks cannot hold NCCL's buffers
        nccl.check_headroom(nccl_bytes - 1, 10 * buckets, rank=1, max_bucket_bytes=64 * mib, where="GPU 0")


def test_unique_id_forms_of_old_and_new_cupy():
    raw = bytes(range(256))[:128]
    signed = tuple(b - 256 if b > 127 else b for b in bytes(range(128, 256)))  # CuPy < 14: negatives
    assert nccl.unique_id_bytes(signed) == bytes(range(128, 256))
    assert nccl.unique_id_bytes(raw) is raw
    assert nccl.unique_id_for_cupy(raw, 14) is raw
    assert nccl.unique_id_for_cupy(nccl.unique_id_bytes(signed), 13) == signed
