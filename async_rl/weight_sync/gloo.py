"""Gloo broadcast group over a stateless TCPStore rendezvous, and the gloo bucket channel.

Never the global default process group: vLLM workers already own one, and so do learner ranks
(their data-parallel group). The store is hosted by rank 0 (the sender).
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from async_rl.errors import RunError
from async_rl.weight_sync.base import BroadcastGroup, BucketChannel, Pending

_PREFIX = "async_rl/weights"


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
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(host))]
        self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
        self._values = dist.PrefixStore("async_rl/values", prefixed)  # apart from gloo's own keys
        self.rank = rank
        self.world_size = world_size

    def start_broadcast(self, buf: torch.Tensor) -> dist.Work:
        # Gloo runs the collective on its own threads: the caller can pack the next bucket meanwhile.
        return self._pg.broadcast(buf, 0)

    def barrier(self) -> None:
        self._pg.barrier().wait()

    def publish(self, key: str, value: bytes) -> None:
        """Rank 0: membership-time data for every member to `fetch` (e.g. a CUDA IPC handle)."""
        self._values.set(key, value)

    def fetch(self, key: str) -> bytes:
        """What rank 0 published under `key` in this membership; waits for it up to the group's timeout."""
        return self._values.get(key)

    def close(self) -> None:
        self._pg = None  # gloo tears its pairs down when the group is released


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
