"""A learner rank's side of batch serving: ask the buffer's ROUTER for this rank's shard of a step."""

from __future__ import annotations

import time

import zmq

from async_rl.errors import RunError
from async_rl.models.cost import TOKENS, CostModel
from async_rl.protocol import SCHEMA_VERSION, BatchRequest, TrajectoryGroup, decode_groups, encode_request
from async_rl.security import ClientKeys, harden_client


class BatchClient:
    def __init__(
        self, address: str, run_id: str, rank: int, world_size: int, curve: ClientKeys | None, cost: CostModel = TOKENS
    ) -> None:
        self.run_id = run_id
        self.cost = cost  # the learner's cost model: the buffer deals the step's ranks by it
        self.rank = rank
        self.world_size = world_size
        self._ctx = zmq.Context()
        self._curve = curve
        self._sock = self._connect(address)
        self._redirect: str | None = None  # set from another thread; only fetch() touches the socket

    def _connect(self, address: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        harden_client(sock, self._curve)  # every socket, also after a redirect to a restarted buffer
        sock.connect(address)
        return sock

    def redirect(self, address: str) -> None:
        """The buffer restarted at `address`: a fetch in progress reconnects and asks again."""
        self._redirect = address

    def fetch(self, step: int, timeout_s: float) -> list[TrajectoryGroup]:
        c = self.cost
        req = BatchRequest(schema=SCHEMA_VERSION, run_id=self.run_id, step=step, rank=self.rank, world_size=self.world_size,
                           attention_weight=c.attention_weight, attention_path=c.path, row_tokens=c.row_tokens)
        self._sock.send(encode_request(req))
        deadline = time.monotonic() + timeout_s
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise RunError(
                    f"learner rank {self.rank}: no batch for step {step} within {timeout_s:.0f}s "
                    "(are the generators producing? see buffer accounting)"
                )
            if self._redirect is not None:
                address, self._redirect = self._redirect, None
                self._sock.close(linger=0)
                self._sock = self._connect(address)
                self._sock.send(encode_request(req))
            if self._sock.poll(min(remaining_ms, 1000)):
                frames = self._sock.recv_multipart()
                header, groups = decode_groups(frames, self.run_id)
                if header.step != step:
                    continue  # a late reply to an earlier request; cannot happen in order, kept safe
                return groups

    def close(self) -> None:
        self._ctx.destroy(linger=0)
