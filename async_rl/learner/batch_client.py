"""A learner rank's side of batch serving: ask the buffer's ROUTER for this rank's shard of a step."""

from __future__ import annotations

import time

import zmq

from async_rl.errors import RunError
from async_rl.protocol import SCHEMA_VERSION, BatchRequest, TrajectoryGroup, decode_groups, encode_request
from async_rl.security import ClientKeys, harden_client


class BatchClient:
    def __init__(self, address: str, run_id: str, rank: int, world_size: int, curve: ClientKeys | None) -> None:
        self.run_id = run_id
        self.rank = rank
        self.world_size = world_size
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        harden_client(self._sock, curve)
        self._sock.connect(address)

    def fetch(self, step: int, timeout_s: float) -> list[TrajectoryGroup]:
        req = BatchRequest(schema=SCHEMA_VERSION, run_id=self.run_id, step=step, rank=self.rank, world_size=self.world_size)
        self._sock.send(encode_request(req))
        deadline = time.monotonic() + timeout_s
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise RunError(
                    f"learner rank {self.rank}: no batch for step {step} within {timeout_s:.0f}s "
                    "(are the generators producing? see buffer accounting)"
                )
            if self._sock.poll(min(remaining_ms, 1000)):
                frames = self._sock.recv_multipart()
                header, groups = decode_groups(frames, self.run_id)
                if header.step != step:
                    continue  # a late reply to an earlier request; cannot happen in order, kept safe
                return groups

    def close(self) -> None:
        self._ctx.destroy(linger=0)
