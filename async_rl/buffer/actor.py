"""The replay buffer process (a Ray async actor): wires the buffer's parts to sockets and control calls.

Ray carries only control calls here (lease, version, stats). Trajectories arrive on a ZMQ PULL
socket; batches leave on a ZMQ ROUTER socket to learner ranks, each rank asking for its shard.
The parts, one job each, share one asyncio condition (`changed`): every state change notifies it.

  prompt_source.py  the prompts, in lease order, and the stream position
  leasing.py        admission control and who holds which lease
  ingest.py         frames in: decode, check, accept or count rejected
  serving.py        waiting groups, batch building, shards out to learner ranks
  snapshot.py       the buffer's state on disk and in run checkpoints
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from async_rl.buffer.ingest import Ingest
from async_rl.buffer.leasing import Leases
from async_rl.buffer.ledger import Accounts, Ledger
from async_rl.buffer.prompt_source import DataPosition, PromptSource
from async_rl.buffer.serving import BatchServer
from async_rl.buffer.snapshot import BufferParts, BufferState, read_snapshot, write_snapshot
from async_rl.cluster.net import advertised_host
from async_rl.config import DataConfig, VisionConfig
from async_rl.errors import RunError
from async_rl.protocol import Prompt, RouteLayout
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

__all__ = ["BufferAddresses", "BufferSettings", "BufferState", "BufferStats", "ReplayBuffer"]


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
    # Where prompts come from and how they are rendered: the model's tokenizer ('' = not rendered,
    # buffer tests only), the longest prompt allowed (max_model_len - max_tokens; 0 = no limit).
    model_dir: str = ""
    # The tokenizer class AutoTokenizer picks for model_dir (chat.tokenizer_class_of, asked by the
    # launching process): loaded directly, the buffer does not import torch ('' = AutoTokenizer here).
    tokenizer_class: str = ""
    max_prompt_tokens: int = 0
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    vision: VisionConfig = msgspec.field(default_factory=VisionConfig)  # how prompts' images are rendered
    snapshot_path: str = ""  # where the buffer snapshots its state at every batch ('' = never)
    restore: bool = False  # start from the snapshot at snapshot_path (a restarted buffer)
    curve: ServerKeys | None = None  # CURVE keys and admitted clients (None: security.curve is off)
    # The model's routes layout when the engines capture routes (a frame's must match); None: no check
    routes: RouteLayout | None = None
    # train.deterministic: batches of the lowest prompt ids in order, fresh prompt ids must rise
    deterministic: bool = False


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
    last_batch_filtered_groups: int = 0  # groups filtered (dynamic sampling) since the batch before it
    ingest_peers: PeerEvents = msgspec.field(default_factory=PeerEvents)
    serve_peers: PeerEvents = msgspec.field(default_factory=PeerEvents)
    data_position: DataPosition = msgspec.field(default_factory=DataPosition)  # the prompt stream's
    skipped_prompts: dict[str, int] = {}  # prompts or data rows that could not be used, by reason
    reward_crashes: int = 0  # samples whose reward worker died mid-call
    reward_pool_restarts: int = 0  # engines' reward pools restarted (wedged or broken), reported by the engines
    storage_error: str = ""  # the first snapshot write that failed (a full disk), one line; '' = none


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
        s = self.s = settings
        self.ledger = Ledger(s.max_lag, s.prompts_per_step * s.group_size, s.group_size)
        self.source = PromptSource.from_settings(
            s.task_name, s.task_seed, s.model_dir, s.max_prompt_tokens, s.data, s.tokenizer_class, s.vision
        )
        if s.deterministic:
            self.source.require_rising_ids()
        self.leases = Leases(self.ledger, self.source, s.group_size)
        rejected: collections.Counter[str] = collections.Counter()
        self._changed = asyncio.Condition()
        self.server = BatchServer(
            s.run_id, s.prompts_per_step, s.max_lag, self.ledger, rejected, lambda: self.ingest.filtered_groups,
            self._changed, self.leases.lowest_pending if s.deterministic else None,
        )
        self.ingest = Ingest(
            s.run_id, s.max_frame_bytes, s.group_size, s.filter_uniform_groups,
            self.ledger, self.leases, rejected, self.server.add, self._changed, s.routes,
        )
        self._parts = BufferParts(
            s.run_id, s.max_frame_bytes, s.group_size, self.ledger, self.source, self.leases, self.ingest,
            self.server, rejected,
        )
        self._rejected = rejected
        self._tasks: list[asyncio.Task] = []
        self._ctx: zmq.asyncio.Context | None = None
        if s.restore:
            snap = read_snapshot(Path(s.snapshot_path), s.run_id)
            if snap is not None:  # None: died before its first batch, a fresh buffer is the same state
                self._parts.restore_snapshot(snap)
        self._auth = None
        self._ingest_peers = PeerEvents()
        self._serve_peers = PeerEvents()
        self._storage_error = ""  # the first failed snapshot write (see save_snapshot)

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
            asyncio.create_task(self.ingest.run(self._pull)),
            asyncio.create_task(self.server.run(self._router, self.save_snapshot)),
            asyncio.create_task(watch_peers(monitors[0], self._ingest_peers)),
            asyncio.create_task(watch_peers(monitors[1], self._serve_peers)),
        ]
        return BufferAddresses(ingest=ingest, serve=serve)

    # ---- control calls (Ray) -------------------------------------------------------------------

    async def lease(self, engine_id: int, max_groups: int, wait_s: float = 1.0) -> list[Prompt]:
        """Up to `max_groups` prompts for an engine; waits up to `wait_s` while admission is closed."""
        deadline = time.monotonic() + wait_s
        async with self._changed:
            if self.leases.is_closed(engine_id):
                return []
            while self.ledger.capacity_groups() == 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except asyncio.TimeoutError:
                    return []
            if self.leases.is_closed(engine_id):  # closed while this call waited
                return []
            prompts = self.leases.grant(engine_id, max_groups)
            if not prompts:  # the stream ran out with nothing in flight: generation_settled waits on that
                self._changed.notify_all()
        if not prompts:
            # A finite prompt stream ran out (stats say so): do not let engines spin on empty leases.
            await asyncio.sleep(wait_s)
        return prompts

    async def generation_settled(self, wait_s: float) -> bool:
        """train.deterministic, before the engines' version moves on: True once every prompt admission
        allows at the version they hold was leased and has arrived (or the prompts ran out); waits up
        to `wait_s` for it. Only then does each step's batch come from one policy version whatever
        the timing."""
        def settled() -> bool:
            full = self.ledger.capacity_groups() == 0 or self.source.exhausted
            return full and self.ledger.accounts.in_flight == 0 and not self.source.returned()

        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(settled), wait_s)
            except asyncio.TimeoutError:
                return False
        return True

    async def set_generator_version(self, version: int) -> None:
        async with self._changed:
            self.ledger.generator_version = version
            self._changed.notify_all()

    async def set_replayed_steps(self, steps: int) -> None:
        """A restarted learner went back to a checkpoint: `steps` steps in all (this run) are trained
        again, and admission lets their batches in (see ledger.py)."""
        async with self._changed:
            self.ledger.replayed_steps = steps
            self._changed.notify_all()

    async def mark_lost(self, engine_id: int, prompt_ids: list[int] | None = None) -> int:
        """Leased prompts that will never come back (failed request, dead engine; None = all of the
        engine's) are counted lost. Returns how many prompts."""
        async with self._changed:  # the ingest loop accepts under the same lock: no double count
            gone = self.leases.lose(engine_id, prompt_ids)
            self._changed.notify_all()
        return len(gone)

    def reward_pool_restarted(self, engine_id: int) -> None:
        """An engine restarted its reward pool (counted with the reward counters, in snapshots too)."""
        self.ingest.reward_pool_restarts += 1

    async def close_engine(self, engine_id: int) -> None:
        """The engine is draining (or dead): it gets no new lease from now on."""
        async with self._changed:
            self.leases.close(engine_id)

    async def requeue(self, engine_id: int, prompt_ids: list[int] | None = None) -> int:
        """Hand the engine's outstanding leases (all, or these) back to the prompt pool: they are
        counted `requeued` and leased again to another engine. A frame that still arrives for one of
        them is rejected (`unknown_prompt` / `wrong_engine`), so no sample is trained twice.
        Returns how many prompts went back."""
        async with self._changed:
            back = self.leases.requeue(engine_id, prompt_ids)
            self._changed.notify_all()
        return back

    async def ack_batch(self, step: int) -> int:
        """Every learner rank finished step `step`: its batch's samples count `trained` now (see
        BatchServer.ack). Idempotent. Returns how many samples."""
        async with self._changed:
            samples = self.server.ack(step)
            self._changed.notify_all()
        if samples:
            self.save_snapshot()
        return samples

    def pid(self) -> int:
        """This actor's process (operators and crash tests kill it by pid)."""
        return os.getpid()

    async def watch(self) -> None:
        """Never returns: the supervisor keeps one call pending and Ray fails it (RayActorError) the
        moment this actor dies, so death is noticed without a poll of a busy event loop."""
        await asyncio.get_running_loop().create_future()

    def outstanding(self, engine_id: int) -> int:
        return self.leases.count(engine_id)

    async def wait_for_batch(self, timeout_s: float) -> bool:
        """Block until a full batch of groups is waiting (colocated placement: generation must finish
        before the engines sleep and the learner takes the cores). False on timeout."""
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self.server.waiting_groups >= self.s.prompts_per_step), timeout_s
                )
            except asyncio.TimeoutError:
                return False
        return True

    def stats(self) -> BufferStats:
        step, max_lag, mean_lag = self.server.last_batch
        return BufferStats(
            accounts=msgspec.structs.replace(self.ledger.accounts),
            generator_version=self.ledger.generator_version,
            waiting_groups=self.server.waiting_groups,
            rejected_frames=dict(self._rejected),
            reward_errors=self.ingest.reward_errors,
            reward_timeouts=self.ingest.reward_timeouts,
            reward_crashes=self.ingest.reward_crashes,
            reward_pool_restarts=self.ingest.reward_pool_restarts,
            last_batch_step=step,
            last_batch_max_lag=max_lag,
            last_batch_mean_lag=mean_lag,
            prompts_exhausted=self.source.exhausted,
            last_batch_filtered_groups=self.server.last_batch_filtered_groups,
            ingest_peers=msgspec.structs.replace(self._ingest_peers),
            serve_peers=msgspec.structs.replace(self._serve_peers),
            data_position=self.source.position,
            skipped_prompts=self.source.skipped,
            storage_error=self._storage_error,
        )

    def checkpoint_state(self) -> BufferState:
        """A consistent snapshot (no await inside: the actor's event loop runs nothing else meanwhile)."""
        return self._parts.checkpoint_state()

    async def restore(self, state: BufferState) -> None:
        """Resume from a run checkpoint, before any lease (see BufferParts.restore_state)."""
        async with self._changed:
            if self.ledger.accounts.leased:
                raise RunError("buffer.restore after prompts were leased: restore must come first")
            self._parts.restore_state(state)
            self._changed.notify_all()

    def save_snapshot(self) -> None:
        """A snapshot that cannot be written (a full disk) leaves the previous one in place and is
        reported in the stats (`storage_error`): the supervisor stops the run with that line. Raising
        here would end the serve loop and leave the learner waiting for a batch."""
        if not self.s.snapshot_path:
            return
        try:
            write_snapshot(Path(self.s.snapshot_path), self._parts.snapshot())
        except RunError as exc:
            self._storage_error = self._storage_error or str(exc)

    async def close(self) -> BufferStats:
        """Stop serving; what is still in flight, and batches handed out but never acknowledged, are
        counted lost. Returns the final stats."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.leases.lose_all()
        self.server.lose_unacked()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            for sock in (self._pull, self._router):
                sock.disable_monitor()
            self._ctx.destroy(linger=0)
            self._ctx = None
        return self.stats()
