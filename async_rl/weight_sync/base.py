"""The weight-sync process boundary: one sender (learner rank 0), many receivers (vLLM workers).

Every update is the same sequence of operations on a control group shared by all members:

    header   version and manifest digest        receivers check both before taking anything
             (and a delta's base version)
    plan     a delta update only: how each tensor travels (weight_sync/delta.py)
    buckets  the manifest's buckets, in order   moved by a `BucketChannel` (gloo, shm, nccl, cuda_ipc)
             (a delta update's are its patches, each no larger than the full bucket)
    trailer  xxh3-64 of every MiB of the update receivers compare the chunks they hashed

Receivers stream the update: each bucket's tensors are handed to the loader as soon as they land
(vLLM's reload takes an iterator). A header, bucket or checksum that does not match raises
`CorruptUpdate`; the engine then stays paused and reports, and never resumes on such weights.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Protocol

import msgspec
import numpy as np
import torch

from async_rl.weight_sync import delta as dl
from async_rl.weight_sync.bucketing import (
    CHECKSUM_MODES,
    Bucket,
    ChunkChecker,
    ChunkTable,
    Manifest,
    pack,
    to_dtype,
    unpack,
)
from async_rl.weight_sync.checksum import ParamChecksum, ShardChecksum


class WeightGroupInfo(msgspec.Struct, frozen=True):
    """Where and how receivers join; `generation` changes with every new membership."""

    host: str
    port: int
    generation: int
    world_size: int
    timeout_s: float
    backend: str = "gloo"  # 'gloo' (bytes over the group), 'shm' (a shared mapping), 'nccl' (GPUs),
    # 'cuda_ipc' (one CUDA allocation mapped by every member; its handle goes through the store at join)
    shm_path: str = ""
    checksum: str = "sampled"  # 'full', 'sampled' or 'off' (see bucketing.ChunkTable)
    nccl_id: bytes = b""  # the NCCL communicator's unique id (backend 'nccl')
    delta: bool = False  # weight_sync.delta resolved: both ends keep a baseline, updates may be deltas


class UpdateReceipt(msgspec.Struct, frozen=True):
    version: int
    manifest_digest: str
    checksum: str  # xxh3-128 of the sender's chunk table ('' when checksums are off)
    nbytes: int
    seconds: float
    chunks_checked: int = 0  # chunks this member hashed (the same ones on every member)
    # learner.lora: the adapter as served (sender: the learner's, computed from its parameters; receiver:
    # read back from vLLM's LoRA slot after loading, not from the bytes received). None: a full update.
    served: ParamChecksum | None = None
    delta: bool = False  # the update was a delta (patches against the version every receiver held)
    sent_bytes: int = 0  # bytes that crossed the channel: the buckets (a delta's patches) and its plan
    # weight_sync.delta, receiver side: this worker's part of what its engine serves after a delta update,
    # for the controller to compare with the learner's (checksum.engine_checksum). None: not taken.
    served_parts: ShardChecksum | None = None
    # Sender side, a delta update: what every engine must now serve (the learner's weights at the wire dtype).
    expected: ParamChecksum | None = None


class SendProgress(msgspec.Struct, frozen=True):
    """How far the sender's current (or last) update got: `buckets_sent` of `buckets_total` buckets
    of `version` have left the sender (their channel operation completed)."""

    version: int = -1
    buckets_sent: int = 0
    buckets_total: int = 0


# Called on the sender after each bucket has moved (a metric, or a test that strikes mid-update).
BucketHook = Callable[[SendProgress], None]


class CorruptUpdate(RuntimeError):
    """An update that failed verification; nothing of it may be served."""


class SyncAborted(RuntimeError):
    """A member of the broadcast group died, or the controller gave up on one: every member abandons
    this membership at once instead of waiting for the group's timeout. Nothing of it is served."""


class Pending(Protocol):
    def wait(self, timeout: timedelta | None = None) -> object:
        """Block until done; with `timeout`, raise RuntimeError('... timed out ...') if not done by then
        (the operation goes on), as torch's c10d Work does."""


class BroadcastGroup(abc.ABC):
    """A group where rank 0 broadcasts buffers to every other rank; operations run in order."""

    @abc.abstractmethod
    def start_broadcast(self, buf: torch.Tensor) -> Pending:
        """Rank 0: start sending `buf`; other ranks: start filling `buf`."""

    def broadcast(self, buf: torch.Tensor) -> None:
        self.wait(self.start_broadcast(buf))

    def wait(self, pending: Pending) -> None:
        """Wait for one operation of this group. A group that can learn of a dead member while it
        waits (gloo: its rendezvous store) raises `SyncAborted` then."""
        pending.wait()

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every member has called it."""

    @abc.abstractmethod
    def close(self) -> None: ...


class BucketChannel(abc.ABC):
    """How one bucket's bytes get from the sender to every receiver."""

    @abc.abstractmethod
    def staging(self, k: int, nbytes: int) -> torch.Tensor:
        """Sender: the buffer to pack bucket k into."""

    @abc.abstractmethod
    def start_send(self, k: int, buf: torch.Tensor) -> Pending:
        """Sender: bucket k is packed in `buf`; make it available to the receivers."""

    @abc.abstractmethod
    def post_receive(self, k: int, nbytes: int) -> tuple[torch.Tensor, Pending]:
        """Receiver: the buffer bucket k will be in, and what to wait on before reading it."""

    def check(self, k: int) -> None:  # noqa: B027 - optional hook, most channels have nothing to check
        """Receiver: called after the wait; raise CorruptUpdate if bucket k is not what arrived."""

    def finish_receive(self) -> None:  # noqa: B027 - optional hook
        """Receiver: the loader has taken (or refused) every bucket of the update; called before the
        end barrier, after which the sender may overwrite the buckets. A channel whose buckets are read
        by asynchronous copies (CUDA) waits for those copies here."""

    def abandon(self) -> None:  # noqa: B027 - optional hook
        """The membership was given up (a member died, or the controller aborted it) while operations
        of this channel may be in flight: cancel them, so nothing keeps waiting for a dead peer."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """The membership is over (a new one replaces it): release what the channel holds."""

    def resident_slot(self, k: int, nbytes: int) -> torch.Tensor | None:
        """Sender: a buffer that is bucket k's for the whole membership, if the channel has one (shm).
        Parameters that live there need no packing: an update reads them where they are."""
        return None


RECEIVE_WINDOW = 2  # buckets a receiver has posted ahead of its loader
# int64 version + 16-byte manifest digest + int64 seed of the checksum's chunk choice + int64 base
# version of a delta update (-1: a full update)
_HEADER_BYTES = 40
FULL = -1
NEEDS_FULL_UPDATE = "it needs a full update"  # ends a receiver's refusal of a delta (the caller retries full)


def _header(version: int, manifest: Manifest, seed: int, base: int = FULL) -> torch.Tensor:
    raw = (
        version.to_bytes(8, "little", signed=True) + manifest.digest_bytes() + seed.to_bytes(8, "little")
        + base.to_bytes(8, "little", signed=True)
    )
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _check_mode(mode: str) -> str:
    if mode not in CHECKSUM_MODES:
        raise ValueError(f"weight checksum mode '{mode}' is not one of {CHECKSUM_MODES}")
    return mode


class WeightSender:
    def __init__(
        self,
        group: BroadcastGroup,
        channel: BucketChannel,
        manifest: Manifest,
        checksum: str,
        on_bucket: Iterable[BucketHook] = (),
        delta: bool = False,
    ) -> None:
        """`on_bucket`: hooks called, in the sending thread, with the progress after every bucket.
        `delta`: keep a baseline (the wire-dtype copy of the last update every receiver loaded: one
        model at the wire dtype, e.g. 2 bytes a parameter for bf16) and send later updates as patches
        against it. A new membership is a new sender: its first update is always full."""
        self.group, self.channel, self.manifest = group, channel, manifest
        self.checksum = _check_mode(checksum)
        self._hooks = list(on_bucket)
        self.progress = SendProgress()  # read by anyone; written only here, one bucket at a time
        self.delta = delta
        self._base: dict[str, torch.Tensor] | None = None
        self.base_version: int | None = None  # the version every receiver holds; None: next is full

    def on_bucket(self, hook: BucketHook) -> None:
        """Call `hook` after every bucket of every later update (see `__init__`)."""
        self._hooks.append(hook)

    def _moved(self, version: int, sent: int) -> None:
        self.progress = SendProgress(version, sent, len(self.manifest.buckets))
        for hook in self._hooks:
            hook(self.progress)

    def adopt(self, tensors: dict[str, torch.Tensor]) -> int:
        """Move tensors (e.g. the learner's parameters) into the channel's resident buffers, in place
        (`t.data` is re-pointed), so that `send` skips their packing copy. Only tensors whose wire
        dtype is their own and that are plain contiguous tensors on the channel's device (CPU for shm,
        the GPU for cuda_ipc) qualify. Returns how many moved.

        The caller must not change them while an update is being read: the controller runs a sync
        only between training steps and waits for every receiver before the next step."""
        moved = 0
        for k, bucket in enumerate(self.manifest.buckets):
            slot = self.channel.resident_slot(k, bucket.nbytes)
            if slot is None:
                return moved
            for spec in bucket.tensors:
                t = tensors[spec.name]
                if type(t.data) is not torch.Tensor or t.device != slot.device or not t.is_contiguous():
                    continue
                if t.dtype != to_dtype(spec.dtype):
                    continue
                view = slot[spec.offset : spec.offset + spec.nbytes].view(t.dtype).view(t.shape)
                if view.data_ptr() != t.data_ptr():
                    view.copy_(t.detach())
                    t.data = view
                moved += 1
        return moved

    def send(self, tensors: dict[str, torch.Tensor], version: int, full: bool = False) -> UpdateReceipt:
        """`full`: send every byte even when a delta could go (the fall-back after a delta's served
        checksum disagreed). The baseline is valid again only once an update completed: one cut
        short (an error, an abort) leaves the next one full."""
        base, self.base_version = self.base_version, None
        with _abandoned_on_abort(self.channel):
            if self.delta and not full and base is not None:
                receipt = self._send_delta(tensors, version, base)
            else:
                receipt = self._send(tensors, version)
        if self.delta:
            self.base_version = version
        return receipt

    def close(self) -> None:
        """This membership is over: release the channel (an NCCL communicator) and the group."""
        _close(self.channel, self.group)

    def _send(self, tensors: dict[str, torch.Tensor], version: int) -> UpdateReceipt:
        t0 = time.perf_counter()
        seed = int.from_bytes(os.urandom(8), "little")  # which chunks 'sampled' hashes this time
        self.group.broadcast(_header(version, self.manifest, seed))
        checker = ChunkChecker(self.manifest, self.checksum, random.Random(seed)) if self.checksum != "off" else None
        pending: Pending | None = None
        self._moved(version, 0)
        if self.delta and self._base is None:
            self._base = dl.baseline_like(self.manifest)
        for k, bucket in enumerate(self.manifest.buckets):
            # Packing bucket k overlaps the transfer of bucket k-1; hashing it overlaps its own.
            buf = pack(bucket, tensors, self.channel.staging(k, bucket.nbytes))
            if self._base is not None:  # what the receivers will hold: the next delta's baseline
                for name, t in unpack(bucket, buf):
                    self._base[name].copy_(t)
            pending = self._send_bucket(version, k, buf, pending, checker)
        table = self._finish(version, self.manifest, pending, checker)
        checked = checker.chunks_checked if checker else 0
        return _receipt(version, self.manifest, table if checker else None, t0, checked)

    def _send_bucket(self, version: int, k: int, buf: torch.Tensor, pending: Pending | None,
                     checker: ChunkChecker | None) -> Pending:
        """Start sending bucket k once bucket k-1 has left (packing k overlapped its transfer); hash it
        while it travels."""
        if pending is not None:
            self.group.wait(pending)
            self._moved(version, k)
        pending = self.channel.start_send(k, buf)
        if checker:
            checker.hash_bucket(k, buf)
        return pending

    def _finish(self, version: int, manifest: Manifest, pending: Pending | None,
                checker: ChunkChecker | None) -> ChunkTable:
        """After the last bucket: the chunk table (of `manifest`, the buckets as sent), then the barrier."""
        if pending is not None:
            self.group.wait(pending)
            self._moved(version, len(manifest.buckets))
        table = ChunkTable(manifest)
        if checker:
            table.fill(checker)
        self.group.broadcast(torch.frombuffer(bytearray(table.to_bytes()), dtype=torch.uint8))
        # Every receiver has loaded (or refused) the update: only now may the caller change the
        # tensors, which matters when they live in the channel itself (`adopt`).
        self.group.barrier()
        return table

    def _send_delta(self, tensors: dict[str, torch.Tensor], version: int, base_version: int) -> UpdateReceipt:
        """The same sequence as `_send`, with a plan after the header and patches for buckets. Two
        passes over the weights (count the changes, then write them bucket by bucket) so that no more
        than one bucket's casts and masks exist at a time."""
        t0 = time.perf_counter()
        base = self._base
        assert base is not None
        seed = int.from_bytes(os.urandom(8), "little")
        buckets = self.manifest.buckets
        with torch.no_grad():
            plan = np.zeros((self.manifest.num_tensors, 2), dtype=np.int64)
            i = 0
            for bucket in buckets:
                for kind, changed, _ in dl.diff_bucket(bucket, _wire(bucket, tensors), base):
                    plan[i] = (kind, changed)
                    i += 1
            sizes = dl.bucket_sizes(self.manifest, plan)
            update = dl.delta_manifest(self.manifest, sizes)
            self.group.broadcast(_header(version, self.manifest, seed, base_version))
            self.group.broadcast(torch.from_numpy(plan.reshape(-1).view(np.uint8).copy()))
            checker = ChunkChecker(update, self.checksum, random.Random(seed)) if self.checksum != "off" else None
            pending: Pending | None = None
            self._moved(version, 0)
            for k, bucket in enumerate(buckets):
                new = _wire(bucket, tensors)
                diffs = dl.diff_bucket(bucket, new, base)
                buf = dl.write_bucket(bucket, diffs, new, self.channel.staging(k, bucket.nbytes))
                if buf.numel() != sizes[k]:
                    raise RuntimeError(f"delta bucket {k}: {buf.numel()} bytes written, the plan says {sizes[k]}")
                for spec, (kind, _, _) in zip(bucket.tensors, diffs, strict=True):
                    if kind != dl.SAME:
                        base[spec.name].copy_(new[spec.name])
                pending = self._send_bucket(version, k, buf, pending, checker)
            table = self._finish(version, update, pending, checker)
        checked = checker.chunks_checked if checker else 0
        receipt = _receipt(version, self.manifest, table if checker else None, t0, checked)
        return msgspec.structs.replace(receipt, delta=True, sent_bytes=sum(sizes) + plan.nbytes)


def _wire(bucket: Bucket, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The bucket's tensors as they go on the wire (cast to the manifest's dtype), contiguous."""
    return {
        spec.name: tensors[spec.name].detach().to(to_dtype(spec.dtype)).contiguous()
        for spec in bucket.tensors
    }


class WeightReceiver:
    def __init__(
        self, group: BroadcastGroup, channel: BucketChannel, manifest: Manifest, checksum: str, delta: bool = False
    ) -> None:
        """`delta`: keep the baseline (a wire-dtype copy of the last update loaded whole: one model at
        the wire dtype in every receiving worker) that later delta updates patch."""
        self.group, self.channel, self.manifest = group, channel, manifest
        self.checksum = _check_mode(checksum)
        self.trailer_bytes = ChunkTable(manifest).nbytes
        self.last_receipt: UpdateReceipt | None = None
        self._trailer_received = False
        self.delta = delta
        self._base: dict[str, torch.Tensor] | None = None
        self.base_version: int | None = None  # the version the baseline holds; None: only a full update

    def stream(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) bucket by bucket; verify the whole update at the end."""
        with _abandoned_on_abort(self.channel):
            yield from self._stream(version)

    def close(self) -> None:
        """This membership is over: release the channel (an NCCL communicator) and the group."""
        _close(self.channel, self.group)

    def _stream(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        t0 = time.perf_counter()
        self.last_receipt = None
        self._trailer_received = False
        header = torch.empty(_HEADER_BYTES, dtype=torch.uint8)
        self.group.broadcast(header)
        raw = header.numpy().tobytes()
        got_version = int.from_bytes(raw[:8], "little", signed=True)
        base_version = int.from_bytes(raw[32:40], "little", signed=True)
        held, self.base_version = self.base_version, None  # valid again once this update is whole
        plan: np.ndarray | None = None
        sizes = [b.nbytes for b in self.manifest.buckets]
        update = self.manifest  # what the checksum covers: the buckets as they travel
        if base_version != FULL:
            raw_plan = torch.empty(dl.plan_nbytes(self.manifest), dtype=torch.uint8)
            self.group.broadcast(raw_plan)
            plan = raw_plan.numpy().view(np.int64).reshape(-1, 2)
            sizes = dl.bucket_sizes(self.manifest, plan)
            update = dl.delta_manifest(self.manifest, sizes)
        trailer_bytes = ChunkTable(update).nbytes
        rejected = ""
        if got_version != version:
            rejected = f"update header says version {got_version}, expected {version}"
        elif raw[8:24] != self.manifest.digest_bytes():
            rejected = "update was packed with another manifest (membership or model changed)"
        elif plan is not None and (self._base is None or held != base_version):
            # Never patch a baseline the delta was not made against: the engine would serve a mix.
            rejected = (
                f"update v{version} is a delta from v{base_version}, but this worker holds "
                f"{'no baseline' if held is None else f'v{held}'}: {NEEDS_FULL_UPDATE}"
            )
        if rejected:
            # Take the rest of the update off the group without loading it, so the sender and the
            # other receivers finish this update instead of timing out; then refuse it.
            for k in range(len(sizes)):
                self.group.wait(self.channel.post_receive(k, sizes[k])[1])
            self.group.broadcast(torch.empty(trailer_bytes, dtype=torch.uint8))
            self._trailer_received = True
            raise CorruptUpdate(rejected)
        if self.delta and self._base is None:
            self._base = dl.baseline_like(self.manifest)
        # Receives are posted a few buckets ahead, not all at once: a receiver holds at most
        # RECEIVE_WINDOW buckets beyond what its loader has taken (not a second copy of the model).
        # Posting order (buckets, then trailer) matches the sender's, as the group requires.
        buckets = self.manifest.buckets
        trailer = torch.empty(trailer_bytes, dtype=torch.uint8)
        posted: collections.deque[tuple[torch.Tensor, Pending]] = collections.deque()
        trailer_pending: Pending | None = None
        next_k = 0

        def post_ahead() -> None:
            nonlocal next_k, trailer_pending
            while len(posted) < RECEIVE_WINDOW and next_k < len(buckets):
                posted.append(self.channel.post_receive(next_k, sizes[next_k]))
                next_k += 1
            if next_k == len(buckets) and trailer_pending is None:
                trailer_pending = self.group.start_broadcast(trailer)

        post_ahead()
        seed = int.from_bytes(raw[24:32], "little")
        checker = ChunkChecker(update, self.checksum, random.Random(seed)) if self.checksum != "off" else None
        first = 0  # the bucket's first row in the plan
        for k, bucket in enumerate(buckets):
            buf, pending = posted.popleft()
            self.group.wait(pending)
            self.channel.check(k)
            if checker:
                checker.hash_bucket(k, buf)
            if plan is not None:
                # The loader gets whole tensors (the patched baseline): vLLM's reload on CPU needs
                # every weight of a layer, and fused QKV / gate-up / expert layouts stay its business.
                assert self._base is not None
                dl.apply_bucket(bucket, plan, first, buf, self._base)
                named = [(spec.name, self._base[spec.name]) for spec in bucket.tensors]
            elif self._base is not None:
                named = unpack(bucket, buf)
                for name, t in named:
                    self._base[name].copy_(t)
            else:
                named = unpack(bucket, buf)
            first += len(bucket.tensors)
            post_ahead()
            yield from named
        self.group.wait(trailer_pending)
        self._trailer_received = True
        table = ChunkTable.from_bytes(update, trailer.numpy().tobytes()) if checker else None
        if checker and (bad := checker.bad_chunks(table)):
            k, j = bad[0]
            raise CorruptUpdate(
                f"update v{version}: checksum mismatch in {len(bad)} of {checker.chunks_checked} chunks checked "
                f"(first: bucket {k}, MiB {j}), the bytes received are not the bytes sent"
            )
        receipt = _receipt(version, self.manifest, table, t0, checker.chunks_checked if checker else 0)
        if plan is not None:
            receipt = msgspec.structs.replace(receipt, delta=True, sent_bytes=sum(sizes) + plan.nbytes)
        self.last_receipt = receipt
        if self._base is not None:
            self.base_version = version

    def receive(self, version: int, consume: Callable[[Iterable[tuple[str, torch.Tensor]]], None]) -> UpdateReceipt:
        """Stream the update into `consume` (e.g. vLLM's reload); returns the verified receipt."""
        it = self.stream(version)
        try:
            consume(it)
            for _ in it:  # a loader that stopped early still gets the update verified
                pass
        finally:
            if self._trailer_received:  # the whole update went by: tell the sender we are done with it
                self.channel.finish_receive()
                with _abandoned_on_abort(self.channel):
                    self.group.barrier()
        assert self.last_receipt is not None
        return self.last_receipt


@contextlib.contextmanager
def _abandoned_on_abort(channel: BucketChannel) -> Iterator[None]:
    """A membership given up mid-update: the channel cancels what it has in flight (see abandon)."""
    try:
        yield
    except SyncAborted:
        channel.abandon()
        raise


def _close(channel: BucketChannel, group: BroadcastGroup) -> None:
    try:
        channel.close()
    finally:
        group.close()


def _receipt(version: int, manifest: Manifest, table: ChunkTable | None, t0: float, checked: int) -> UpdateReceipt:
    return UpdateReceipt(
        version=version,
        manifest_digest=manifest.digest(),
        checksum=table.digest() if table else "",
        nbytes=manifest.total_bytes,
        seconds=time.perf_counter() - t0,
        chunks_checked=checked,
        sent_bytes=manifest.total_bytes,
    )
