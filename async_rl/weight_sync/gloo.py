"""Gloo broadcast group over a stateless TCPStore rendezvous, and the gloo bucket channel.

Never the global default process group: vLLM workers already own one, and so do learner ranks
(their data-parallel group). The store is hosted by rank 0 (the sender).
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from async_rl.errors import RunError, first_line
from async_rl.weight_sync.base import (
    BroadcastGroup,
    BucketChannel,
    CorruptUpdate,
    Pending,
    SyncAborted,
    WeightGroupInfo,
)

_PREFIX = "async_rl/weights"
_ABORT = "abort"  # set (with the reason) by any member, or the controller, that gave up on this membership
ABORT_POLL_S = 0.05  # how often a waiting member looks for the abort key on the store
_ABANDONED: list[dist.ProcessGroupGloo] = []  # groups given up on (see GlooGroup._abandon)
SLICE_TIMED_OUT = "Operation timed out"  # c10d Work.wait(timeout) when the slice ran out (the op goes on)


def host_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0: start the rendezvous store (port 0 = any free port; read it back from `.port`)."""
    try:
        return dist.TCPStore(
            host, port, world_size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
    except (RuntimeError, OSError) as exc:
        if "in use" in str(exc).lower():
            raise RunError(f"weight_sync.port: port {port} on {host} is already in use") from None
        raise RunError(f"weight_sync: cannot start the rendezvous store on {host}:{port}: {exc}") from None


def local_address_towards(host: str) -> str:
    """This process's address on the route to `host` (the rendezvous): the interface its gloo pairs
    bind to. Gloo's default resolves the machine's hostname, which on a multi-homed node (or in a
    network namespace) names another interface, or falls back to loopback, and peers on other
    nodes could not connect."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP connect sends nothing; the kernel picks the route's source address
        return s.getsockname()[0]


class GlooGroup(BroadcastGroup):
    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        store: dist.TCPStore | None = None,
        generation: int = 0,
    ) -> None:
        timeout = timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        self._store = store
        prefixed = dist.PrefixStore(f"{_PREFIX}/{generation}", store)
        self._control = control_store(store, generation)
        self._values = dist.PrefixStore("async_rl/values", prefixed)  # apart from gloo's own keys
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._next_abort_check = 0.0
        self._await_members()
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        # Gloo pairs bind on the route to the rendezvous host (see local_address_towards).
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(host))]
        self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, options)

    def _await_members(self) -> None:
        """Our own rendezvous before gloo's, because gloo's cannot be interrupted: a member that died
        before joining would hold every other member for the whole timeout."""
        self._control.set(f"joined/{self.rank}", b"1")
        keys = [f"joined/{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + self.timeout_s
        while not self._control.check(keys):
            self._check_abort(force=True)
            if time.monotonic() > deadline:
                raise RunError(f"weight_sync: the broadcast group did not form within {self.timeout_s:.0f}s")
            time.sleep(ABORT_POLL_S)

    def wait(self, pending: Pending) -> None:
        """Wait in slices, looking at the store for an abort between them, so a dead member costs
        every other one at most ABORT_POLL_S after someone noticed, not the group's timeout. A member
        whose own operation fails (gloo saw a peer's connection drop) sets the abort for the others.
        (Not `is_completed()` polling: with that, a peer's death froze every Python thread of the
        process until gloo's timeout, seen here with torch 2.13; `wait` releases the GIL.)"""
        slice_ = timedelta(seconds=ABORT_POLL_S)
        while True:
            try:
                pending.wait(slice_)
                return
            except (CorruptUpdate, SyncAborted):
                raise
            except RuntimeError as exc:
                if SLICE_TIMED_OUT not in str(exc):
                    reason = f"rank {self.rank}: {first_line(exc, limit=500)}"
                    self.abort(reason)
                    self._abandon()
                    raise SyncAborted(f"weight sync abandoned: {reason}") from None
            try:
                self._check_abort(force=True)
            except SyncAborted:
                self._abandon()
                raise

    def _abandon(self) -> None:
        """Cancel this group's operations still posted (a receiver posts ahead): otherwise gloo's
        destructor, which runs with the GIL held, waits for them until the group's timeout and
        freezes the whole process."""
        try:
            self._pg.abort()
        except RuntimeError:
            pass
        # Kept referenced: should abort leave an operation posted, the group is destroyed only once
        # that operation timed out, never while a later membership is in use.
        _ABANDONED.append(self._pg)

    def abort(self, reason: str) -> None:
        """Tell every member to abandon this membership (the first reason set wins)."""
        try:
            self._control.compare_set(_ABORT, "", reason)
        except RuntimeError:
            pass  # the store's host (the sender) is gone: the others find that out themselves

    def _check_abort(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_abort_check:
            return
        self._next_abort_check = now + ABORT_POLL_S
        try:
            if not self._control.check([_ABORT]):
                return
            reason = self._control.get(_ABORT).decode()
        except RuntimeError as exc:  # the store lives in the sender's process: it died
            raise SyncAborted(f"weight sync abandoned: the group's store is unreachable ({exc})") from None
        raise SyncAborted(f"weight sync abandoned: {reason}")

    def start_broadcast(self, buf: torch.Tensor) -> dist.Work:
        # Gloo runs the collective on its own threads: the caller can pack the next bucket meanwhile.
        return self._pg.broadcast(buf, 0)

    def barrier(self) -> None:
        self.wait(self._pg.barrier())

    def publish(self, key: str, value: bytes) -> None:
        """Rank 0: membership-time data for every member to `fetch` (e.g. a CUDA IPC handle)."""
        self._values.set(key, value)

    def fetch(self, key: str) -> bytes:
        """What rank 0 published under `key` in this membership; waits for it up to the group's timeout."""
        return self._values.get(key)

    def close(self) -> None:
        self._pg = None  # gloo tears its pairs down when the group is released


def control_store(store: dist.Store, generation: int) -> dist.PrefixStore:
    return dist.PrefixStore(f"{_PREFIX}/{generation}/control", store)


def abort_membership(info: WeightGroupInfo, reason: str) -> None:
    """The controller saw a member die: every member of `info`'s membership stops waiting (see
    GlooGroup.wait). Best effort: a store that is gone has no one left to tell."""
    try:
        store = dist.TCPStore(info.host, info.port, is_master=False, timeout=timedelta(seconds=5))
        control_store(store, info.generation).compare_set(_ABORT, "", reason)
    except (RuntimeError, OSError):
        pass


class GlooChannel(BucketChannel):
    """Bucket bytes over the gloo group itself (works across hosts). Two staging buffers on the
    sender, so bucket k+1 is packed while bucket k is on the wire."""

    def __init__(self, group: GlooGroup, max_bucket_bytes: int) -> None:
        self.group = group
        self.max_bucket_bytes = max_bucket_bytes
        self._staging: list[torch.Tensor] = []

    def staging(self, k: int, nbytes: int) -> torch.Tensor:
        if not self._staging:
            self._staging = [torch.empty(self.max_bucket_bytes, dtype=torch.uint8) for _ in range(2)]
        return self._staging[k % 2][:nbytes]

    def start_send(self, k: int, buf: torch.Tensor) -> Pending:
        return self.group.start_broadcast(buf)

    def post_receive(self, k: int, nbytes: int) -> tuple[torch.Tensor, Pending]:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf, self.group.start_broadcast(buf)
