"""The replay buffer process (a Ray async actor): ZMQ ingest, prompt leases, batch serving.

Ray carries only control calls here (lease, version, stats). Trajectories arrive on a ZMQ PULL
socket; batches leave on a ZMQ ROUTER socket to learner ranks, each rank asking for its shard.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import time
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from async_rl.buffer.ledger import Accounts, Ledger
from async_rl.buffer.snapshot import BufferSnapshot, Lease, read_snapshot, write_snapshot
from async_rl.cluster.resources import advertised_host
from async_rl.errors import RunError
from async_rl.protocol import (
    REWARD_CRASH,
    REWARD_ERROR,
    REWARD_TIMEOUT,
    FrameError,
    Prompt,
    TrajectoryGroup,
    decode_groups,
    decode_request,
    encode_groups,
)
from async_rl.security import (
    INGEST_DOMAIN,
    MAX_REQUEST_BYTES,
    SERVE_DOMAIN,
    PeerEvents,
    ServerKeys,
    harden_server,
    monitor_socket,
    start_authenticator,
    watch_peers,
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
    snapshot_path: str = ""  # where the buffer snapshots its state at every batch ('' = never)
    restore: bool = False  # start from the snapshot at snapshot_path (a restarted buffer)
    curve: ServerKeys | None = None  # CURVE keys and admitted clients (None: security.curve is off)


class BufferAddresses(msgspec.Struct, frozen=True):
    ingest: str
    serve: str


class BufferState(msgspec.Struct, kw_only=True):
    """What a checkpoint keeps of the buffer: the sample accounting and the prompt stream position."""

    accounts: Accounts
    generator_version: int
    prompts_drawn: int  # prompts taken from the task's stream so far
    rejected_frames: dict[str, int]
    reward_errors: int
    reward_timeouts: int
    # Prompts the resumed run must generate: those handed back and not yet leased again, and those
    # in flight when the checkpoint was written (their samples die with that run's engines).
    returned: list[Prompt] = msgspec.field(default_factory=list)
    reward_crashes: int = 0


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
    last_batch_filtered_groups: int = 0  # groups filtered (dynamic sampling) since the batch before it
    reward_crashes: int = 0  # samples whose reward worker died mid-call
    ingest_peers: PeerEvents = msgspec.field(default_factory=PeerEvents)
    serve_peers: PeerEvents = msgspec.field(default_factory=PeerEvents)


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
    return f"tcp://{advertised_host(host)}:{port}"


# SPURIOUS_WAKEUP: with CURVE + ZAP, an asyncio receive sometimes fails with zmq.Again right after a
# peer's handshake (seen here with pyzmq 27 / libzmq 4.3.5, in about 4 of 5 runs of the fuzz test;
# libzmq queues a ZAP credential ahead of the peer's first frame, which marks the socket readable
# but is skipped by a receive). Nothing was lost: wait again rather than let the loop die.


class ReplayBuffer:
    def __init__(self, settings: BufferSettings) -> None:
        self.s = settings
        self.ledger = Ledger(settings.max_lag, settings.prompts_per_step * settings.group_size, settings.group_size)
        self._prompts = load_task(settings.task_name).prompts(settings.task_seed)
        self._prompts_drawn = 0
        self._returned: collections.deque[Prompt] = collections.deque()  # handed back, leased first
        self._closed_engines: set[int] = set()  # draining or dead: no new leases
        self._outstanding: dict[int, tuple[int, Prompt]] = {}  # prompt_id -> (engine_id, prompt)
        self._waiting: collections.deque[TrajectoryGroup] = collections.deque()
        self._batches: dict[int, list[list[TrajectoryGroup]]] = {}
        self._served: dict[int, set[int]] = collections.defaultdict(set)
        self._rejected: collections.Counter[str] = collections.Counter()
        self._reward_errors = 0
        self._reward_timeouts = 0
        self._reward_crashes = 0
        self._last_batch = (-1, 0, 0.0)
        self._prompts_exhausted = False  # a finite task stream ran out
        self._filtered_groups = 0  # groups dropped by dynamic sampling, ever
        self._filtered_at_batch = (0, 0)  # (_filtered_groups at the last batch, the last batch's share)
        self._changed = asyncio.Condition()
        self._tasks: list[asyncio.Task] = []
        self._ctx: zmq.asyncio.Context | None = None
        if settings.restore:
            self._restore()
        self._auth = None
        self._ingest_peers = PeerEvents()
        self._serve_peers = PeerEvents()

    async def start(self) -> BufferAddresses:
        self._ctx = zmq.asyncio.Context()
        self._auth = start_authenticator(self._ctx, self.s.curve)  # before any bind: fail closed
        self._pull = self._ctx.socket(zmq.PULL)
        self._router = self._ctx.socket(zmq.ROUTER)
        harden_server(self._pull, self.s.curve, INGEST_DOMAIN, self.s.max_frame_bytes)
        harden_server(self._router, self.s.curve, SERVE_DOMAIN, MAX_REQUEST_BYTES)
        self._monitors = monitors = [monitor_socket(self._pull), monitor_socket(self._router)]
        ingest = bind(self._pull, self.s.host, self.s.ingest_port, "buffer.ingest_port")
        serve = bind(self._router, self.s.host, self.s.serve_port, "buffer.serve_port")
        self._tasks = [
            asyncio.create_task(self._ingest_loop()),
            asyncio.create_task(self._serve_loop()),
            asyncio.create_task(watch_peers(monitors[0], self._ingest_peers)),
            asyncio.create_task(watch_peers(monitors[1], self._serve_peers)),
        ]
        return BufferAddresses(ingest=ingest, serve=serve)

    # ---- control calls (Ray) -------------------------------------------------------------------

    async def lease(self, engine_id: int, max_groups: int, wait_s: float = 1.0) -> list[Prompt]:
        """Up to `max_groups` prompts for an engine; waits up to `wait_s` while admission is closed."""
        deadline = time.monotonic() + wait_s
        async with self._changed:
            if engine_id in self._closed_engines:
                return []
            while self.ledger.capacity_groups() == 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except asyncio.TimeoutError:
                    return []
            if engine_id in self._closed_engines:  # closed while this call waited
                return []
            want = min(max_groups, self.ledger.capacity_groups())
            prompts = [self._returned.popleft() for _ in range(min(want, len(self._returned)))]
            fresh = list(itertools.islice(self._prompts, want - len(prompts)))
            self._prompts_drawn += len(fresh)
            prompts += fresh
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

    async def close_engine(self, engine_id: int) -> None:
        """The engine is draining (or dead): it gets no new lease from now on."""
        async with self._changed:
            self._closed_engines.add(engine_id)

    async def requeue(self, engine_id: int, prompt_ids: list[int] | None = None) -> int:
        """Hand the engine's outstanding leases (all, or these) back to the prompt pool: they are
        counted `requeued` and leased again to another engine. A frame that still arrives for one of
        them is rejected (`unknown_prompt` / `wrong_engine`), so no sample is trained twice.
        Returns how many prompts went back."""
        async with self._changed:
            self._closed_engines.add(engine_id)
            back = self._take_outstanding(engine_id, prompt_ids)
            for prompt in back:
                self.ledger.requeued_lease(self.s.group_size)
                self._returned.append(prompt)
            self._changed.notify_all()
        return len(back)

    def pid(self) -> int:
        """This actor's process (operators and crash tests kill it by pid)."""
        return os.getpid()

    def outstanding(self, engine_id: int) -> int:
        return sum(1 for eid, _ in self._outstanding.values() if eid == engine_id)

    def _take_outstanding(self, engine_id: int, prompt_ids: list[int] | None) -> list[Prompt]:
        wanted = None if prompt_ids is None else set(prompt_ids)
        gone = [pid for pid, (eid, _) in self._outstanding.items() if eid == engine_id and (wanted is None or pid in wanted)]
        return [self._outstanding.pop(pid)[1] for pid in gone]

    def _forget(self, engine_id: int, prompt_ids: list[int] | None) -> list[int]:
        """Caller holds the lock: drop the engine's outstanding prompts (all, or these), count them lost."""
        gone = self._take_outstanding(engine_id, prompt_ids)
        for _ in gone:
            self.ledger.lost(self.s.group_size)
        return [p.prompt_id for p in gone]

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
            reward_crashes=self._reward_crashes,
            last_batch_step=step,
            last_batch_max_lag=max_lag,
            last_batch_mean_lag=mean_lag,
            prompts_exhausted=self._prompts_exhausted,
            last_batch_filtered_groups=self._filtered_at_batch[1],
            ingest_peers=msgspec.structs.replace(self._ingest_peers),
            serve_peers=msgspec.structs.replace(self._serve_peers),
        )

    def checkpoint_state(self) -> BufferState:
        """A consistent snapshot (no await inside: the actor's event loop runs nothing else meanwhile)."""
        return BufferState(
            accounts=msgspec.structs.replace(self.ledger.accounts),
            generator_version=self.ledger.generator_version,
            prompts_drawn=self._prompts_drawn,
            rejected_frames=dict(self._rejected),
            reward_errors=self._reward_errors,
            reward_timeouts=self._reward_timeouts,
            reward_crashes=self._reward_crashes,
            returned=[*self._returned, *(prompt for _, prompt in self._outstanding.values())],
        )

    async def restore(self, state: BufferState) -> None:
        """Resume from a checkpoint, before any lease: the prompt stream continues after the last
        prompt drawn, the accounting goes on from the saved counts, and the prompts handed back or in
        flight at checkpoint time are leased first (in flight ones counted `requeued`: generated
        again, not lost). Groups that were waiting died with that run: they are counted lost."""
        async with self._changed:
            if self.ledger.accounts.leased:
                raise RunError("buffer.restore after prompts were leased: restore must come first")
            a = msgspec.structs.replace(state.accounts)
            if state.returned:  # older checkpoints kept no prompts: their in-flight samples are lost
                a.requeued += a.in_flight
            else:
                a.lost += a.in_flight
            a.lost += a.waiting
            a.in_flight = a.waiting = 0
            self._returned.extend(state.returned)
            self.ledger.accounts = a
            self.ledger.generator_version = state.generator_version
            self._prompts = load_task(self.s.task_name).prompts(self.s.task_seed)
            collections.deque(itertools.islice(self._prompts, state.prompts_drawn), maxlen=0)
            self._prompts_drawn = state.prompts_drawn
            self._rejected = collections.Counter(state.rejected_frames)
            self._reward_errors = state.reward_errors
            self._reward_timeouts = state.reward_timeouts
            self._reward_crashes = state.reward_crashes
            self._changed.notify_all()

    async def close(self) -> BufferStats:
        """Stop serving; what is still in flight is counted lost. Returns the final stats."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for _pid, _ in list(self._outstanding.items()):
            self.ledger.lost(self.s.group_size)
        self._outstanding.clear()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            for sock in (self._pull, self._router):
                sock.disable_monitor()
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
            try:
                batch = [await self._pull.recv_multipart()]
            except zmq.Again:
                continue  # spurious wake-up, see SPURIOUS_WAKEUP
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
        self._reward_crashes += sum(1 for s in g.reward_status if s == REWARD_CRASH)
        if self.s.filter_uniform_groups and len(set(g.rewards)) == 1:
            self.ledger.arrived_filtered(g.size)
            self._filtered_groups += 1
        else:
            self.ledger.arrived(g.size)
            self._waiting.append(g)

    async def _serve_loop(self) -> None:
        while True:
            try:
                identity, *parts = await self._router.recv_multipart()
            except zmq.Again:
                continue  # spurious wake-up, see SPURIOUS_WAKEUP
            try:
                if len(parts) != 1:
                    raise FrameError("bad_request", f"expected 1 part, got {len(parts)}")
                req = decode_request(parts[0], self.s.run_id)
            except FrameError as exc:
                self._rejected[exc.reason] += 1
                continue
            if req.step not in self._batches:
                self._batches[req.step] = await self._build_batch(req.step, req.world_size)
                self.save_snapshot()  # the moment samples become 'trained'; no await since the build
            shards = self._batches[req.step]
            frames = encode_groups(self.s.run_id, shards[req.rank], step=req.step)
            await self._router.send_multipart([identity, *frames])
            self._served[req.step].add(req.rank)
            if len(self._served[req.step]) == req.world_size:
                del self._batches[req.step], self._served[req.step]

    # ---- snapshot and restore --------------------------------------------------------------------

    def save_snapshot(self) -> None:
        if not self.s.snapshot_path:
            return
        snap = BufferSnapshot(
            run_id=self.s.run_id,
            accounts=msgspec.structs.replace(self.ledger.accounts),
            prompts_drawn=self._prompts_drawn,
            returned=list(self._returned),
            outstanding=[Lease(engine_id=eid, prompt=p) for eid, p in self._outstanding.values()],
            waiting=[encode_groups(self.s.run_id, [g]) for g in self._waiting],
            batches={
                step: [encode_groups(self.s.run_id, shard, step=step) for shard in shards]
                for step, shards in self._batches.items()
            },
            rejected_frames=dict(self._rejected),
            reward_errors=self._reward_errors,
            reward_timeouts=self._reward_timeouts,
            reward_crashes=self._reward_crashes,
        )
        write_snapshot(Path(self.s.snapshot_path), snap)

    def _restore(self) -> None:
        """Continue from the last snapshot (see buffer/snapshot.py for why nothing doubles)."""
        snap = read_snapshot(Path(self.s.snapshot_path), self.s.run_id)
        if snap is None:
            return  # died before its first batch: a fresh buffer is the same state
        self.ledger.accounts = snap.accounts
        for _ in itertools.islice(self._prompts, snap.prompts_drawn):
            pass
        self._prompts_drawn = snap.prompts_drawn
        self._returned.extend(snap.returned)
        for lease in snap.outstanding:  # their engines now talk to a buffer that never leased them
            self.ledger.requeued_lease(self.s.group_size)
            self._returned.append(lease.prompt)
        for frames in snap.waiting:
            self._waiting.extend(decode_groups(frames, self.s.run_id, self.s.max_frame_bytes)[1])
        for step, shards in snap.batches.items():
            self._batches[step] = [decode_groups(f, self.s.run_id, self.s.max_frame_bytes)[1] for f in shards]
        self._rejected.update(snap.rejected_frames)
        self._reward_errors, self._reward_timeouts = snap.reward_errors, snap.reward_timeouts
        self._reward_crashes = snap.reward_crashes

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
        self._filtered_at_batch = (self._filtered_groups, self._filtered_groups - self._filtered_at_batch[0])
        per_rank = need // world_size
        return [batch[r * per_rank : (r + 1) * per_rank] for r in range(world_size)]
