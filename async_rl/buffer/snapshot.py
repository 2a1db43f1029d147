"""The buffer's state on disk, so a dead buffer restarts where it was, and the part of it a run
checkpoint keeps.

The buffer writes one snapshot each time it builds a batch (the moment samples become `trained`),
atomically (temporary file, then rename). What happened after the last snapshot is redone, never
doubled: prompts leased since then are drawn again from the same seeded stream (the snapshot keeps
the stream position), leases that were outstanding at snapshot time are handed back to the pool
(`requeued`), and frames that arrive for leases the restored buffer does not know are rejected
(`unknown_prompt`). Groups trained before the snapshot are not in its waiting list, so none is
trained twice.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

import msgspec

from async_rl import storage
from async_rl.buffer.ingest import Ingest
from async_rl.buffer.leasing import Lease, Leases
from async_rl.buffer.ledger import Accounts, Ledger
from async_rl.buffer.prompt_source import DataPosition, PromptSource
from async_rl.buffer.serving import BatchServer
from async_rl.errors import RunError
from async_rl.protocol import Prompt, decode_groups, encode_groups

SNAPSHOT_SCHEMA = 1
SNAPSHOT_NAME = "buffer_snapshot.msgpack"
# The run id a checkpoint's groups are framed with: a resumed run has a new run id of its own.
CHECKPOINT_FRAMES = "checkpoint"

__all__ = ["Lease", "BufferSnapshot", "BufferState", "BufferParts", "write_snapshot", "read_snapshot"]


class BufferSnapshot(msgspec.Struct, kw_only=True):
    schema: int = SNAPSHOT_SCHEMA
    run_id: str
    accounts: Accounts
    prompts_drawn: int  # fresh prompts taken from the stream so far
    returned: list[Prompt]  # handed-back prompts waiting to be leased again
    outstanding: list[Lease]  # leases in flight at snapshot time
    waiting: list[list[bytes]]  # each complete group waiting, in wire framing (encode_groups)
    batches: dict[int, list[list[bytes]]]  # step -> per-rank shard frames built but not all served
    rejected_frames: dict[str, int]
    reward_errors: int
    reward_timeouts: int
    position: DataPosition | None = None  # exact stream position (None: older snapshots, = (0, prompts_drawn))
    skipped_prompts: dict[str, int] = {}
    reward_crashes: int = 0
    reward_pool_restarts: int = 0


class BufferState(msgspec.Struct, kw_only=True):
    """What a checkpoint keeps of the buffer: the sample accounting and the prompt stream position."""

    accounts: Accounts
    generator_version: int
    prompts_drawn: int  # fresh prompts taken from the stream so far
    rejected_frames: dict[str, int]
    reward_errors: int
    reward_timeouts: int
    # Prompts the resumed run must generate: those handed back and not yet leased again, and those
    # in flight when the checkpoint was written (their samples die with that run's engines).
    returned: list[Prompt] = msgspec.field(default_factory=list)
    position: DataPosition | None = None  # exact stream position (None: older checkpoints, = (0, prompts_drawn))
    skipped_prompts: dict[str, int] = {}  # prompts or rows that could not be used, by reason
    reward_crashes: int = 0  # samples whose reward worker died mid-call
    reward_pool_restarts: int = 0  # engines' reward pools restarted
    replayed_steps: int = 0  # steps trained again after learner recoveries (admission counts them)
    # Complete groups generated but not yet trained at checkpoint time (those of batches built ahead
    # first, then the waiting ones), each in wire framing: the resumed run trains them. Kept apart from
    # run_state.json (checkpoint.GROUPS_FILE); empty in older checkpoints, whose waiting groups are lost.
    groups: list[list[bytes]] = msgspec.field(default_factory=list)


def _position(position: DataPosition | None, drawn: int) -> DataPosition:
    return position if position is not None else DataPosition(epoch=0, index=drawn)


def write_snapshot(path: Path, snap: BufferSnapshot) -> None:
    """Atomic: a reader sees the previous snapshot or this one, never half of one. A write that fails
    (a full disk: RunError naming the bytes needed and free) leaves no partial file behind."""
    tmp = path.with_name(path.name + ".tmp")
    data = msgspec.msgpack.encode(snap)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if storage.out_of_space(exc):
            raise RunError(storage.space_line("buffer snapshot", path, len(data))) from None
        if why := storage.place_problem(path.parent):
            raise RunError(f"buffer snapshot {path}: its folder {why}") from None
        raise RunError(f"buffer snapshot {path}: {exc}") from None


def read_snapshot(path: Path, run_id: str) -> BufferSnapshot | None:
    """The snapshot at `path`, or None when there is none yet. Another run's snapshot is an error."""
    if not path.is_file():
        return None
    snap = msgspec.msgpack.decode(path.read_bytes(), type=BufferSnapshot)
    if snap.schema != SNAPSHOT_SCHEMA or snap.run_id != run_id:
        raise ValueError(f"buffer snapshot {path} is of schema {snap.schema}, run '{snap.run_id}', not this run")
    return snap


class BufferParts:
    """The buffer's components as the snapshot and checkpoint code sees them: it reads each part's
    state and restores it through the part's own methods."""

    def __init__(
        self,
        run_id: str,
        max_frame_bytes: int,
        group_size: int,
        ledger: Ledger,
        source: PromptSource,
        leases: Leases,
        ingest: Ingest,
        server: BatchServer,
        rejected: collections.Counter[str],
    ) -> None:
        self.run_id = run_id
        self.max_frame_bytes = max_frame_bytes
        self.group_size = group_size
        self.ledger = ledger
        self.source = source
        self.leases = leases
        self.ingest = ingest
        self.server = server
        self.rejected = rejected

    # ---- the buffer's own snapshot (restart of a dead buffer) ------------------------------------

    def snapshot(self) -> BufferSnapshot:
        return BufferSnapshot(
            run_id=self.run_id,
            accounts=msgspec.structs.replace(self.ledger.accounts),
            prompts_drawn=self.source.drawn,
            returned=self.source.returned(),
            outstanding=self.leases.held(),
            waiting=[encode_groups(self.run_id, [g]) for g in self.server.waiting()],
            batches={
                step: [encode_groups(self.run_id, shard, step=step) for shard in shards]
                for step, shards in self.server.built().items()
            },
            rejected_frames=dict(self.rejected),
            reward_errors=self.ingest.reward_errors,
            reward_timeouts=self.ingest.reward_timeouts,
            reward_crashes=self.ingest.reward_crashes,
            reward_pool_restarts=self.ingest.reward_pool_restarts,
            position=self.source.position,
            skipped_prompts=self.source.skipped,
        )

    def restore_snapshot(self, snap: BufferSnapshot) -> None:
        """Continue from a snapshot (see the module doc for why nothing doubles)."""
        self.ledger.accounts = snap.accounts
        self.source.seek(_position(snap.position, snap.prompts_drawn), snap.prompts_drawn, snap.skipped_prompts)
        self.source.give_back(snap.returned)
        # Leases outstanding at snapshot time: their engines now talk to a buffer that never leased them.
        for held in snap.outstanding:
            self.ledger.requeued_lease(self.group_size)
            self.source.give_back([held.prompt])
        waiting = [g for frames in snap.waiting for g in self._decode(frames)]
        built = {step: [self._decode(f) for f in shards] for step, shards in snap.batches.items()}
        self.server.restore(waiting, built)
        self.rejected.update(snap.rejected_frames)
        self.ingest.restore_counters(
            snap.reward_errors, snap.reward_timeouts, snap.reward_crashes, snap.reward_pool_restarts
        )

    def _decode(self, frames: list[bytes]):
        return decode_groups(frames, self.run_id, self.max_frame_bytes)[1]

    # ---- a run checkpoint (--resume) -----------------------------------------------------------

    def checkpoint_state(self) -> BufferState:
        """A consistent state (no await inside: the actor's event loop runs nothing else meanwhile)."""
        return BufferState(
            accounts=msgspec.structs.replace(self.ledger.accounts),
            generator_version=self.ledger.generator_version,
            prompts_drawn=self.source.drawn,
            rejected_frames=dict(self.rejected),
            reward_errors=self.ingest.reward_errors,
            reward_timeouts=self.ingest.reward_timeouts,
            reward_crashes=self.ingest.reward_crashes,
            reward_pool_restarts=self.ingest.reward_pool_restarts,
            returned=[*self.source.returned(), *(lease.prompt for lease in self.leases.held())],
            position=self.source.position,
            skipped_prompts=self.source.skipped,
            replayed_steps=self.ledger.replayed_steps,
            groups=[encode_groups(CHECKPOINT_FRAMES, [g]) for g in self._untrained()],
        )

    def _untrained(self):
        """Every complete group not yet trained: those of batches built ahead (in step order), then
        the waiting ones; the order the resumed run trains them in."""
        built = self.server.built()
        ahead = [g for step in sorted(built) for shard in built[step] for g in shard]
        return [*ahead, *self.server.waiting()]

    def restore_state(self, state: BufferState) -> None:
        """Resume from a checkpoint, before any lease: the prompt stream continues after the last
        prompt drawn, the accounting goes on from the saved counts, and the prompts handed back or in
        flight at checkpoint time are leased first (in flight ones counted `requeued`: generated
        again, not lost). Groups generated but not yet trained come back waiting, and are trained
        first (still subject to the staleness bound); only a checkpoint that kept none (older ones)
        counts them lost."""
        a = msgspec.structs.replace(state.accounts)
        if state.returned:  # older checkpoints kept no prompts: their in-flight samples are lost
            a.requeued += a.in_flight
        else:
            a.lost += a.in_flight
        groups = [g for frames in state.groups for g in decode_groups(frames, CHECKPOINT_FRAMES, self.max_frame_bytes)[1]]
        kept = sum(g.episode_count for g in groups)
        a.lost += a.waiting - kept
        a.in_flight, a.waiting = 0, kept
        self.server.restore(groups, {})
        self.ledger.accounts = a
        self.ledger.generator_version = state.generator_version
        self.ledger.replayed_steps = state.replayed_steps
        self.source.seek(_position(state.position, state.prompts_drawn), state.prompts_drawn, state.skipped_prompts)
        self.source.give_back(state.returned)
        self.rejected.clear()
        self.rejected.update(state.rejected_frames)
        self.ingest.restore_counters(
            state.reward_errors, state.reward_timeouts, state.reward_crashes, state.reward_pool_restarts
        )
