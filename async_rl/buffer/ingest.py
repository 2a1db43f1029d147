"""Ingest: trajectory frames off the ZMQ PULL socket, decoded, checked against the leases, accepted.

A frame that fails any check is counted under its reason and dropped; when its header named leases
of its own engine, those are counted lost (their samples will never arrive in a usable form).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

import zmq
import zmq.asyncio

from async_rl.buffer.leasing import Leases
from async_rl.buffer.ledger import Ledger
from async_rl.protocol import (
    REWARD_CRASH,
    REWARD_ERROR,
    REWARD_TIMEOUT,
    FrameError,
    GroupsHeader,
    RouteLayout,
    TrajectoryGroup,
    decode_groups,
)

# Frames taken off the ingest socket per wake-up of the ingest loop (bounded, so control calls and
# batch serving still get the event loop between batches).
INGEST_BATCH_FRAMES = 256


class Ingest:
    def __init__(
        self,
        run_id: str,
        max_frame_bytes: int,
        group_size: int,
        filter_uniform_groups: bool,
        ledger: Ledger,
        leases: Leases,
        rejected: collections.Counter[str],
        deliver: Callable[[TrajectoryGroup], None],
        changed: asyncio.Condition,
        routes: RouteLayout | None = None,
    ) -> None:
        self._run_id = run_id
        self._max_frame_bytes = max_frame_bytes
        self._group_size = group_size
        self._filter_uniform = filter_uniform_groups
        self._ledger = ledger
        self._leases = leases
        self._rejected = rejected  # the buffer's tally of rejected frames (shared with batch serving)
        self._deliver = deliver  # where accepted groups go (batch serving's waiting queue)
        self._changed = changed  # the buffer's condition: notified on every state change
        self._routes = routes  # the model's routes layout (None: not checked)
        self.reward_errors = 0
        self.reward_timeouts = 0
        self.reward_crashes = 0  # reward worker died mid-call
        self.reward_pool_restarts = 0  # engines' reward pools found wedged or broken and started anew
        self.filtered_groups = 0  # groups dropped by dynamic sampling, ever

    def restore_counters(
        self, reward_errors: int, reward_timeouts: int, reward_crashes: int, reward_pool_restarts: int = 0
    ) -> None:
        self.reward_errors, self.reward_timeouts = reward_errors, reward_timeouts
        self.reward_crashes, self.reward_pool_restarts = reward_crashes, reward_pool_restarts

    def ingest_frame(self, frames: list[bytes]) -> None:
        """Caller holds the buffer's lock: decode, check and accept one frame, or count it rejected."""
        try:
            header, groups = decode_groups(frames, self._run_id, self._max_frame_bytes)
            seen: set[int] = set()
            try:
                self.check_routes(header)
                for g in groups:
                    self.check_group(g, seen)
            except FrameError as exc:
                exc.header = header
                raise
        except FrameError as exc:
            self._rejected[exc.reason] += 1
            self._release_rejected(exc)
            return
        for g in groups:
            self.accept(g)

    def _release_rejected(self, exc: FrameError) -> None:
        """A rejected frame whose header named leased prompts of its own engine: those samples will
        never arrive in a usable form, so they are counted lost (and admission capacity freed)."""
        if exc.header is None:
            return
        for meta in exc.header.groups:
            if self._leases.owner(meta.prompt_id) == meta.engine_id:
                self._leases.lose(meta.engine_id, [meta.prompt_id])

    def check_routes(self, header: GroupsHeader) -> None:
        """A frame's routes were recorded on the model the learner trains: its MoE layers and top-k."""
        got, want = header.routes, self._routes
        if got is not None and want is not None and got != want:
            engines = sorted({g.engine_id for g in header.groups})
            raise FrameError(
                "bad_routes", f"engine {engines}: routes of {got.layers} MoE layers x top-{got.top_k} x {got.itemsize} "
                f"byte(s), the model has {want.layers} x top-{want.top_k} x {want.itemsize}",
            )

    def check_group(self, g: TrajectoryGroup, seen: set[int]) -> None:
        if g.prompt_id in seen:
            raise FrameError("duplicate_prompt", f"prompt {g.prompt_id} twice in one frame")
        seen.add(g.prompt_id)
        owner = self._leases.owner(g.prompt_id)
        if owner is None:
            raise FrameError("unknown_prompt", f"prompt {g.prompt_id} is not leased (late or duplicate)")
        if owner != g.engine_id:
            raise FrameError("wrong_engine", f"prompt {g.prompt_id} was leased to engine {owner}")
        if g.episode_count != self._group_size:  # episodes, not samples: a split episode is several
            raise FrameError(
                "group_size", f"prompt {g.prompt_id}: {g.episode_count} episodes, want {self._group_size}"
            )

    def accept(self, g: TrajectoryGroup) -> None:
        """Counted in episodes (the leased unit): a split agent episode's segments count once."""
        self._leases.settle(g.prompt_id)
        status = [g.reward_status[i] for i in g.episode_last_samples()]
        self.reward_errors += sum(1 for s in status if s == REWARD_ERROR)
        self.reward_timeouts += sum(1 for s in status if s == REWARD_TIMEOUT)
        self.reward_crashes += sum(1 for s in status if s == REWARD_CRASH)
        if self._filter_uniform and len(set(g.rewards)) == 1:
            self._ledger.arrived_filtered(g.episode_count)
            self.filtered_groups += 1
        else:
            self._ledger.arrived(g.episode_count)
            self._deliver(g)

    async def run(self, pull: zmq.asyncio.Socket) -> None:
        """The ingest loop. One await, one lock and one wake-up of the waiters per *batch* of queued
        frames, not per frame: at thousands of small frames a second the per-frame asyncio round
        trip cost more than decoding. The rest of a batch is drained without blocking through a
        synchronous shadow of the same socket (the asyncio socket checks for queued messages before
        it waits)."""
        drain = zmq.Socket.shadow(pull.underlying)
        while True:
            try:
                batch = [await pull.recv_multipart()]
            except zmq.Again:
                continue  # spurious wake-up, see SPURIOUS_WAKEUP in buffer/actor.py
            while len(batch) < INGEST_BATCH_FRAMES:
                try:
                    batch.append(drain.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
            async with self._changed:  # check and accept atomically with respect to mark_lost
                for frames in batch:
                    self.ingest_frame(frames)
                self._changed.notify_all()
            # While frames keep arriving, neither the recv above (a message is already queued) nor
            # the uncontended lock ever suspends: without this yield the loop would starve control
            # calls (leases, stats) and batch serving for as long as the producers keep up.
            await asyncio.sleep(0)
