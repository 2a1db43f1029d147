"""The buffer's state on disk, so a dead buffer restarts where it was.

The buffer writes one snapshot each time it builds a batch (the moment samples become `trained`),
atomically (temporary file, then rename). What happened after the last snapshot is redone, never
doubled: prompts leased since then are drawn again from the same seeded stream (the snapshot keeps
the stream position), leases that were outstanding at snapshot time are handed back to the pool
(`requeued`), and frames that arrive for leases the restored buffer does not know are rejected
(`unknown_prompt`). Groups trained before the snapshot are not in its waiting list, so none is
trained twice.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from async_rl.buffer.ledger import Accounts
from async_rl.protocol import Prompt

SNAPSHOT_SCHEMA = 1
SNAPSHOT_NAME = "buffer_snapshot.msgpack"


class Lease(msgspec.Struct, frozen=True):
    engine_id: int
    prompt: Prompt


class BufferSnapshot(msgspec.Struct, kw_only=True):
    schema: int = SNAPSHOT_SCHEMA
    run_id: str
    accounts: Accounts
    prompts_drawn: int  # prompts taken from the task's stream so far (restart skips this many)
    returned: list[Prompt]  # handed-back prompts waiting to be leased again
    outstanding: list[Lease]  # leases in flight at snapshot time
    waiting: list[list[bytes]]  # each complete group waiting, in wire framing (encode_groups)
    batches: dict[int, list[list[bytes]]]  # step -> per-rank shard frames built but not all served
    rejected_frames: dict[str, int]
    reward_errors: int
    reward_timeouts: int
    reward_crashes: int = 0


def write_snapshot(path: Path, snap: BufferSnapshot) -> None:
    """Atomic: a reader sees the previous snapshot or this one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(msgspec.msgpack.encode(snap))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_snapshot(path: Path, run_id: str) -> BufferSnapshot | None:
    """The snapshot at `path`, or None when there is none yet. Another run's snapshot is an error."""
    if not path.is_file():
        return None
    snap = msgspec.msgpack.decode(path.read_bytes(), type=BufferSnapshot)
    if snap.schema != SNAPSHOT_SCHEMA or snap.run_id != run_id:
        raise ValueError(f"buffer snapshot {path} is of schema {snap.schema}, run '{snap.run_id}', not this run")
    return snap
