"""The data plane against hostile peers, with the real ReplayBuffer actor under Ray and CURVE on.

- A peer with the engine key fires >10,000 random, truncated, bit-flipped, wrong-run and oversized
  frames at the ingest socket: the buffer survives, rejects and counts every one, its memory stays
  bounded, and it still accepts and serves a valid frame afterwards.
- Peers without the key (no CURVE, random keys, the learner's key, a forged server key) cannot
  inject a frame or fetch a batch.
- Frames of another run id or schema version are rejected and counted.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import psutil
import pytest
import ray
import zmq

from async_rl.buffer.actor import BufferSettings, BufferStats, ReplayBuffer
from async_rl.learner.batch_client import BatchClient
from async_rl.protocol import (
    SCHEMA_VERSION,
    BatchRequest,
    GroupsHeader,
    TrajectoryGroup,
    encode_groups,
    encode_request,
)
from async_rl.security import ClientKeys, RunKeys, harden_client, make_run_keys

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RUN = "run-a"
GROUP = 2
MAX_FRAME = 1 << 20  # the buffer's frame limit (and ZMQ per-part cap) in these tests
NOT_LEASED = 10**9  # fuzz frames name prompts far from the ones the task stream leases


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=100 << 20,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
    )
    yield
    ray.shutdown()


@pytest.fixture
def keys() -> RunKeys:
    return make_run_keys()


@pytest.fixture
def buffer(keys):
    settings = BufferSettings(
        run_id=RUN,
        host="127.0.0.1",
        ingest_port=0,
        serve_port=0,
        max_lag=1,
        prompts_per_step=1,
        group_size=GROUP,
        filter_uniform_groups=False,
        max_frame_bytes=MAX_FRAME,
        task_name="repeat",
        task_seed=0,
        curve=keys.server,
    )
    actor = ray.remote(ReplayBuffer).options(num_cpus=0).remote(settings)
    addresses = ray.get(actor.start.remote(), timeout=60)
    yield actor, addresses
    ray.get(actor.close.remote(), timeout=30)
    ray.kill(actor, no_restart=True)


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def push_socket(ctx: zmq.Context, address: str, keys: ClientKeys | None) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    harden_client(sock, keys)
    sock.connect(address)
    return sock


def group(prompt_id: int, completion_len: int = 2) -> TrajectoryGroup:
    return TrajectoryGroup(
        prompt_id=prompt_id,
        engine_id=0,
        prompt_tokens=np.array([5, 6], dtype=np.int32),
        completions=[np.full(completion_len, 7, dtype=np.int32)] * GROUP,
        logprobs=[np.full(completion_len, -0.5, dtype=np.float32)] * GROUP,
        rewards=[0.0, 1.0],
        version_first=[0] * GROUP,
        version_last=[0] * GROUP,
        reward_status=[0] * GROUP,
    )


def stats(actor) -> BufferStats:
    return ray.get(actor.stats.remote(), timeout=30)


def wait_for(actor, want: Callable[[BufferStats], bool], timeout_s: float = 120.0) -> BufferStats:
    """Poll the buffer until `want` holds (the actor works through its socket queue meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = stats(actor)
        if want(s):
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"buffer never reached the expected state: {s}")
        time.sleep(0.05)


def counted(s: BufferStats) -> int:
    """Every frame the buffer turned away: rejected by the decoder, or dropped by ZMQ's part cap
    (which disconnects the sender: one disconnect per oversized part, the test peers never leave)."""
    return sum(s.rejected_frames.values()) + s.ingest_peers.disconnects


def rss_bytes(actor) -> int:
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    return psutil.Process(pid).memory_info().rss


class Fuzzer:
    """Bad frames of every kind, all naming prompts that were never leased: even a bit flip that
    still decodes is rejected (unknown_prompt), so every frame sent must land in a counter."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        kinds = {
            self.random_parts: 20,
            self.truncated: 20,
            self.bit_flipped: 35,
            self.msgpack_junk: 8,
            self.wrong_run: 6,
            self.wrong_schema: 6,
            self.too_large_total: 5,  # ~1 MiB each: most of the bytes sent
        }
        self.kinds, self.weights = list(kinds), list(kinds.values())

    def valid(self) -> list[bytes]:
        pid = NOT_LEASED + self.rng.randrange(10**6)
        return encode_groups(RUN, [group(pid, completion_len=self.rng.randrange(1, 300))])

    def random_parts(self) -> list[bytes]:
        return [self.rng.randbytes(self.rng.randrange(0, 400)) for _ in range(self.rng.randrange(1, 6))]

    def truncated(self) -> list[bytes]:
        parts = self.valid()
        if self.rng.random() < 0.2:
            return parts[: self.rng.randrange(0, 3)] or [b""]  # a part missing (ZMQ sends no 0-part message)
        i = self.rng.randrange(3)
        parts[i] = parts[i][: self.rng.randrange(0, max(1, len(parts[i])))]
        return parts

    def bit_flipped(self) -> list[bytes]:
        parts = [bytearray(p) for p in self.valid()]
        for _ in range(self.rng.randrange(1, 9)):
            i = self.rng.randrange(3)
            if parts[i]:
                j = self.rng.randrange(len(parts[i]))
                parts[i][j] ^= 1 << self.rng.randrange(8)
        return [bytes(p) for p in parts]

    def msgpack_junk(self) -> list[bytes]:
        junk = self.rng.choice([{"schema": 1}, [1, 2, 3], "x" * 50, {"run_id": RUN, "groups": "nope"}, 2**40, None])
        return [msgspec.msgpack.encode(junk), b"", b""]

    def wrong_run(self) -> list[bytes]:
        return encode_groups("run-b", [group(NOT_LEASED)])

    def wrong_schema(self) -> list[bytes]:
        parts = self.valid()
        header = msgspec.msgpack.decode(parts[0], type=GroupsHeader)
        parts[0] = msgspec.msgpack.encode(msgspec.structs.replace(header, schema=SCHEMA_VERSION + 1))
        return parts

    def too_large_total(self) -> list[bytes]:
        """Every part under the per-part cap, the frame over the limit: the decoder rejects it."""
        n = MAX_FRAME // 4 // 2 + 1000
        return encode_groups(RUN, [group(NOT_LEASED, completion_len=n // GROUP)])

    def frame(self) -> list[bytes]:
        return self.rng.choices(self.kinds, self.weights)[0]()


def test_fuzzed_ingest_rejects_and_counts_every_frame_and_keeps_working(buffer, keys, zctx):
    actor, addresses = buffer
    fuzzer = Fuzzer(seed=1234)
    peer = push_socket(zctx, addresses.ingest, keys.engine)
    # Oversized parts come from their own peer, one at a time: ZMQ disconnects the sender of a part
    # over the cap (and drops whatever that connection had in flight), so the next one waits for the
    # reconnect. The main peer is unaffected and keeps streaming meanwhile.
    big_peer = push_socket(zctx, addresses.ingest, keys.engine)
    big_part = b"\x00" * (2 * MAX_FRAME)

    # Warm up (allocator pools, Python caches) before the memory baseline.
    warm = 300
    for _ in range(warm):
        peer.send_multipart(fuzzer.frame())
    wait_for(actor, lambda s: counted(s) == warm)
    rss_before = rss_bytes(actor)

    n_fuzz, n_big, sent_bytes = 10_000, 10, 0
    big_every = n_fuzz // n_big
    for i in range(n_fuzz):
        frames = fuzzer.frame()
        sent_bytes += sum(len(f) for f in frames)
        peer.send_multipart(frames)
        if i % big_every == 0:
            k = i // big_every + 1
            big_peer.send_multipart([big_part, b"", b""])
            sent_bytes += len(big_part)
            # dropped, then reconnected (the first handshake of big_peer happened before)
            wait_for(actor, lambda s, k=k: s.ingest_peers.disconnects == k and s.ingest_peers.handshakes == k + 2)
    total = warm + n_fuzz + n_big
    s = wait_for(actor, lambda s: counted(s) >= total)
    assert counted(s) == total, s
    assert s.ingest_peers.disconnects == n_big
    # Nothing was accepted: no lease was taken, so nothing may be waiting or in flight.
    assert s.accounts == type(s.accounts)()
    assert s.rejected_frames.keys() >= {"bad_header", "run_id", "schema_version", "too_large", "unknown_prompt"}
    assert s.ingest_peers.auth_denied == s.ingest_peers.protocol_failed == 0

    # Memory stays bounded: far less growth than what went through the socket.
    growth = rss_bytes(actor) - rss_before
    assert sent_bytes > 400 << 20
    assert growth < 64 << 20, f"buffer RSS grew by {growth >> 20} MiB after {sent_bytes >> 20} MiB of bad frames"

    # The buffer still accepts a valid frame and serves it to a learner rank.
    (prompt,) = ray.get(actor.lease.remote(0, 1))
    peer.send_multipart(encode_groups(RUN, [group(prompt.prompt_id)]))
    s = wait_for(actor, lambda s: s.accounts.waiting == GROUP)
    assert counted(s) == total
    client = BatchClient(addresses.serve, RUN, rank=0, world_size=1, curve=keys.learner)
    try:
        (served,) = client.fetch(step=0, timeout_s=30)
    finally:
        client.close()
    assert served.prompt_id == prompt.prompt_id and served.size == GROUP
    assert stats(actor).accounts.trained == 0  # fetched is not trained: the learner may still die
    assert ray.get(actor.ack_batch.remote(0)) == GROUP
    assert stats(actor).accounts.trained == GROUP


def test_peers_without_the_key_cannot_inject_or_fetch(buffer, keys, zctx):
    actor, addresses = buffer
    victim, legit = ray.get(actor.lease.remote(0, 2))
    forged_pub, forged_sec = zmq.curve_keypair()
    attackers = {
        "no CURVE": (None, "protocol_failed"),
        "random client keys": (ClientKeys(keys.engine.server_public, *zmq.curve_keypair()), "auth_denied"),
        "the learner's key on ingest": (keys.learner, "auth_denied"),
        "a forged server key": (ClientKeys(forged_pub, keys.engine.public, keys.engine.secret), "protocol_failed"),
    }
    for name, (attacker_keys, failure) in attackers.items():
        before = getattr(stats(actor).ingest_peers, failure)  # before connecting: it fails fast
        sock = push_socket(zctx, addresses.ingest, attacker_keys)
        # A frame that would be accepted if it got through: it names a prompt leased to engine 0.
        sock.send_multipart(encode_groups(RUN, [group(victim.prompt_id)]))
        s = wait_for(actor, lambda s, f=failure, b=before: getattr(s.ingest_peers, f) > b)
        assert s.ingest_peers.handshakes == 0, name
        sock.close()  # a peer refused at the protocol level would otherwise retry forever
    # The engine's key gets through; only its frame is accepted, the attackers' frames never arrived.
    engine = push_socket(zctx, addresses.ingest, keys.engine)
    engine.send_multipart(encode_groups(RUN, [group(legit.prompt_id)]))
    s = wait_for(actor, lambda s: s.accounts.waiting == GROUP)
    assert s.accounts.in_flight == GROUP  # the victim prompt is still out: no forged frame landed
    assert s.rejected_frames == {}  # they never reached the decoder either
    assert s.ingest_peers.handshakes == 1

    # The serve socket admits only the learner key: the engine key (or none) fetches nothing.
    for attacker_keys, failure in ((keys.engine, "auth_denied"), (None, "protocol_failed")):
        before = getattr(stats(actor).serve_peers, failure)
        thief = zctx.socket(zmq.DEALER)
        harden_client(thief, attacker_keys)
        thief.connect(addresses.serve)
        request = BatchRequest(schema=SCHEMA_VERSION, run_id=RUN, step=0, rank=0, world_size=1)
        thief.send(encode_request(request))  # queued until a handshake that never succeeds
        wait_for(actor, lambda s, f=failure, b=before: getattr(s.serve_peers, f) > b)
        assert not thief.poll(200)
        thief.close()
    s = stats(actor)
    assert s.serve_peers.handshakes == 0 and s.accounts.trained == 0 and s.rejected_frames == {}


def test_frames_of_another_run_or_schema_are_rejected_and_counted(buffer, keys, zctx):
    actor, addresses = buffer
    (prompt,) = ray.get(actor.lease.remote(0, 1))
    peer = push_socket(zctx, addresses.ingest, keys.engine)
    peer.send_multipart(encode_groups("another-run", [group(prompt.prompt_id)]))
    s = wait_for(actor, lambda s: s.rejected_frames.get("run_id") == 1)
    frames = encode_groups(RUN, [group(prompt.prompt_id)])
    header = msgspec.msgpack.decode(frames[0], type=GroupsHeader)
    peer.send_multipart([msgspec.msgpack.encode(msgspec.structs.replace(header, schema=SCHEMA_VERSION + 1)), *frames[1:]])
    s = wait_for(actor, lambda s: s.rejected_frames.get("schema_version") == 1)
    # Neither was accepted, and the lease is untouched: the right frame still lands.
    assert s.accounts.in_flight == GROUP and s.accounts.waiting == 0
    peer.send_multipart(frames)
    s = wait_for(actor, lambda s: s.accounts.waiting == GROUP)
    assert s.rejected_frames == {"run_id": 1, "schema_version": 1}
