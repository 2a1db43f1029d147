"""The replay buffer process (a Ray async actor): ZMQ ingest, prompt leases, batch serving.

Ray carries only control calls here (lease, version, stats). Trajectories arrive on a ZMQ PULL
socket; batches leave on a ZMQ ROUTER socket to learner ranks, each rank asking for its shard.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time

import msgspec
import zmq
import zmq.asyncio

from async_rl.buffer.ledger import Accounts, Ledger
from async_rl.errors import RunError
from async_rl.protocol import (
    REWARD_ERROR,
    REWARD_TIMEOUT,
    FrameError,
    Prompt,
    TrajectoryGroup,
    decode_groups,
    decode_request,
    encode_groups,
)
from async_rl.tasks.base import load_task

# Frames taken off the ingest socket per wake-up of the ingest loop (bounded, so control calls and
# batch serving still get the event loop between batches).
INGEST_BATCH_FRAMES = 256


class BufferSettings(msgspec.Struct, frozen=True):
    run_id: str
    host: str
    ingest_port: int
    serve_port: int
    max_lag: int
    prompts_per_step: int
    group_size: int
    filter_uniform_groups: bool
    max_frame_bytes: int
    task_name: str
    task_seed: int


class BufferAddresses(msgspec.Struct, frozen=True):
    ingest: str
    serve: str


class BufferStats(msgspec.Struct):
    accounts: Accounts
    generator_version: int
    waiting_groups: int
    rejected_frames: dict[str, int]
    reward_errors: int
    reward_timeouts: int
    last_batch_step: int
    last_batch_max_lag: int
    last_batch_mean_lag: float
    prompts_exhausted: bool


def bind(socket: zmq.Socket, host: str, port: int, field: str) -> str:
    """Bind to host:port (0 = a free port); a port in use is a one-line RunError naming the field."""
    try:
        if port == 0:
            port = socket.bind_to_random_port(f"tcp://{host}")
        else:
            socket.bind(f"tcp://{host}:{port}")
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EADDRINUSE:
            raise RunError(f"{field}: port {port} on {host} is already in use") from None
        raise RunError(f"{field}: cannot bind tcp://{host}:{port}: {exc}") from None
    return f"tcp://{host}:{port}"


class ReplayBuffer:
    def __init__(self, settings: BufferSettings) -> None:
        self.s = settings
        self.ledger = Ledger(settings.max_lag, settings.prompts_per_step * settings.group_size, settings.group_size)
        self._prompts = load_task(settings.task_name).prompts(settings.task_seed)
        self._outstanding: dict[int, tuple[int, Prompt]] = {}  # prompt_id -> (engine_id, prompt)
        self._waiting: collections.deque[TrajectoryGroup] = collections.deque()
        self._batches: dict[int, list[list[TrajectoryGroup]]] = {}
        self._served: dict[int, set[int]] = collections.defaultdict(set)
        self._rejected: collections.Counter[str] = collections.Counter()
        self._reward_errors = 0
        self._reward_timeouts = 0
        self._last_batch = (-1, 0, 0.0)
        self._prompts_exhausted = False  # a finite task stream ran out
        self._changed = asyncio.Condition()
        self._tasks: list[asyncio.Task] = []
        self._ctx: zmq.asyncio.Context | None = None

    async def start(self) -> BufferAddresses:
        self._ctx = zmq.asyncio.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._router = self._ctx.socket(zmq.ROUTER)
        for sock in (self._pull, self._router):
            sock.setsockopt(zmq.LINGER, 0)
        ingest = bind(self._pull, self.s.host, self.s.ingest_port, "buffer.ingest_port")
        serve = bind(self._router, self.s.host, self.s.serve_port, "buffer.serve_port")
        self._tasks = [asyncio.create_task(self._ingest_loop()), asyncio.create_task(self._serve_loop())]
        return BufferAddresses(ingest=ingest, serve=serve)

    # ---- control calls (Ray) -------------------------------------------------------------------

    async def lease(self, engine_id: int, max_groups: int, wait_s: float = 1.0) -> list[Prompt]:
        """Up to `max_groups` prompts for an engine; waits up to `wait_s` while admission is closed."""
        deadline = time.monotonic() + wait_s
        async with self._changed:
            while self.ledger.capacity_groups() == 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except asyncio.TimeoutError:
                    return []
            prompts = list(itertools.islice(self._prompts, min(max_groups, self.ledger.capacity_groups())))
            self.ledger.lease(len(prompts))
            for p in prompts:
                self._outstanding[p.prompt_id] = (engine_id, p)
        if not prompts:
            # A finite task ran out: say so, and do not let engines spin on empty leases.
            self._prompts_exhausted = True
            await asyncio.sleep(wait_s)
        return prompts

    async def set_generator_version(self, version: int) -> None:
        async with self._changed:
            self.ledger.generator_version = version
            self._changed.notify_all()

    async def mark_lost(self, engine_id: int, prompt_ids: list[int] | None = None) -> int:
        """Leased prompts that will never come back (failed request, dead engine; None = all of the
        engine's) are counted lost. Returns how many prompts."""
        async with self._changed:  # the ingest loop accepts under the same lock: no double count
            gone = self._forget(engine_id, prompt_ids)
            self._changed.notify_all()
        return len(gone)

    def _forget(self, engine_id: int, prompt_ids: list[int] | None) -> list[int]:
        """Caller holds the lock: drop the engine's outstanding prompts (all, or these), count them lost."""
        wanted = None if prompt_ids is None else set(prompt_ids)
        gone = [pid for pid, (eid, _) in self._outstanding.items() if eid == engine_id and (wanted is None or pid in wanted)]
        for pid in gone:
            del self._outstanding[pid]
            self.ledger.lost(self.s.group_size)
        return gone

    async def wait_for_batch(self, timeout_s: float) -> bool:
        """Block until a full batch of groups is waiting (colocated placement: generation must finish
        before the engines sleep and the learner takes the cores). False on timeout."""
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: len(self._waiting) >= self.s.prompts_per_step), timeout_s
                )
            except asyncio.TimeoutError:
                return False
        return True

    def stats(self) -> BufferStats:
        step, max_lag, mean_lag = self._last_batch
        return BufferStats(
            accounts=msgspec.structs.replace(self.ledger.accounts),
            generator_version=self.ledger.generator_version,
            waiting_groups=len(self._waiting),
            rejected_frames=dict(self._rejected),
            reward_errors=self._reward_errors,
            reward_timeouts=self._reward_timeouts,
            last_batch_step=step,
            last_batch_max_lag=max_lag,
            last_batch_mean_lag=mean_lag,
            prompts_exhausted=self._prompts_exhausted,
        )

    async def close(self) -> BufferStats:
        """Stop serving; what is still in flight is counted lost. Returns the final stats."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for _pid, _ in list(self._outstanding.items()):
            self.ledger.lost(self.s.group_size)
        self._outstanding.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
        return self.stats()

    # ---- data plane (ZMQ) ----------------------------------------------------------------------

    async def _ingest_loop(self) -> None:
        # One await, one lock and one wake-up of the waiters per *batch* of queued frames, not per
        # frame: at thousands of small frames a second the per-frame asyncio round trip cost more
        # than decoding. The rest of a batch is drained without blocking through a synchronous
        # shadow of the same socket (the asyncio socket checks for queued messages before it waits).
        drain = zmq.Socket.shadow(self._pull.underlying)
        while True:
            batch = [await self._pull.recv_multipart()]
            while len(batch) < INGEST_BATCH_FRAMES:
                try:
                    batch.append(drain.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
            async with self._changed:  # check and accept atomically with respect to mark_lost
                for frames in batch:
                    self._ingest_frame(frames)
                self._changed.notify_all()
            # While frames keep arriving, neither the recv above (a message is already queued) nor
            # the uncontended lock ever suspends: without this yield the loop would starve control
            # calls (leases, stats) and batch serving for as long as the producers keep up.
            await asyncio.sleep(0)

    def _ingest_frame(self, frames: list[bytes]) -> None:
        """Caller holds the lock: decode, check and accept one frame, or count it rejected."""
        try:
            header, groups = decode_groups(frames, self.s.run_id, self.s.max_frame_bytes)
            seen: set[int] = set()
            try:
                for g in groups:
                    self._check_group(g, seen)
            except FrameError as exc:
                exc.header = header
                raise
        except FrameError as exc:
            self._rejected[exc.reason] += 1
            self._release_rejected(exc)
            return
        for g in groups:
            self._accept(g)

    def _release_rejected(self, exc: FrameError) -> None:
        """A rejected frame whose header named leased prompts of its own engine: those samples will
        never arrive in a usable form, so they are counted lost (and admission capacity freed)."""
        if exc.header is None:
            return
        for meta in exc.header.groups:
            owner = self._outstanding.get(meta.prompt_id)
            if owner is not None and owner[0] == meta.engine_id:
                self._forget(meta.engine_id, [meta.prompt_id])

    def _check_group(self, g: TrajectoryGroup, seen: set[int]) -> None:
        if g.prompt_id in seen:
            raise FrameError("duplicate_prompt", f"prompt {g.prompt_id} twice in one frame")
        seen.add(g.prompt_id)
        owner = self._outstanding.get(g.prompt_id)
        if owner is None:
            raise FrameError("unknown_prompt", f"prompt {g.prompt_id} is not leased (late or duplicate)")
        if owner[0] != g.engine_id:
            raise FrameError("wrong_engine", f"prompt {g.prompt_id} was leased to engine {owner[0]}")
        if g.size != self.s.group_size:
            raise FrameError("group_size", f"prompt {g.prompt_id}: {g.size} samples, want {self.s.group_size}")

    def _accept(self, g: TrajectoryGroup) -> None:
        del self._outstanding[g.prompt_id]
        self._reward_errors += sum(1 for s in g.reward_status if s == REWARD_ERROR)
        self._reward_timeouts += sum(1 for s in g.reward_status if s == REWARD_TIMEOUT)
        if self.s.filter_uniform_groups and len(set(g.rewards)) == 1:
            self.ledger.arrived_filtered(g.size)
        else:
            self.ledger.arrived(g.size)
            self._waiting.append(g)

    async def _serve_loop(self) -> None:
        while True:
            identity, raw = await self._router.recv_multipart()
            try:
                req = decode_request(raw, self.s.run_id)
            except FrameError as exc:
                self._rejected[exc.reason] += 1
                continue
            if req.step not in self._batches:
                self._batches[req.step] = await self._build_batch(req.step, req.world_size)
            shards = self._batches[req.step]
            frames = encode_groups(self.s.run_id, shards[req.rank], step=req.step)
            await self._router.send_multipart([identity, *frames])
            self._served[req.step].add(req.rank)
            if len(self._served[req.step]) == req.world_size:
                del self._batches[req.step], self._served[req.step]

    async def _build_batch(self, step: int, world_size: int) -> list[list[TrajectoryGroup]]:
        """Take `prompts_per_step` fresh groups (FIFO), dropping stale ones; learner version == step."""
        need = self.s.prompts_per_step
        batch: list[TrajectoryGroup] = []
        async with self._changed:
            while len(batch) < need:
                while not self._waiting:
                    await self._changed.wait()
                g = self._waiting.popleft()
                if Ledger.is_stale(g.oldest_version, step, self.s.max_lag):
                    self.ledger.dropped_stale(g.size)
                    self._changed.notify_all()  # dropping frees admission capacity
                    continue
                batch.append(g)
            for g in batch:
                self.ledger.trained(g.size)
            self._changed.notify_all()
        lags = [step - g.oldest_version for g in batch]
        self._last_batch = (step, max(lags), sum(lags) / len(lags))
        per_rank = need // world_size
        return [batch[r * per_rank : (r + 1) * per_rank] for r in range(world_size)]
