"""Securing the ZMQ data plane: per-run CURVE keys, socket hardening, peer accounting.

The controller makes one server keypair (the buffer's) and one client keypair per role (engines,
learner ranks) for every run, and hands each process only what it needs through its settings.
The buffer's two sockets authenticate clients by public key through a ZAP handler: the ingest
socket admits only the engine key, the serve socket only the learner key, so a learner key
cannot inject trajectories and an engine key cannot fetch batches. Everything is encrypted.

The secret keys travel on Ray's control plane (actor arguments): that plane must be trusted
(a private network, or Ray's own TLS); the data-plane keys add nothing against someone who
controls Ray, but stop any other peer that can reach the ZMQ ports.
"""

from __future__ import annotations

import sys

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from async_rl.errors import RunError

INGEST_DOMAIN = "async_rl.ingest"
SERVE_DOMAIN = "async_rl.serve"
# A batch request is a ~60-byte msgpack map: anything much larger is not one.
MAX_REQUEST_BYTES = 64 << 10
# Per token on the wire: an int32 id and a float32 behaviour log-prob.
_BYTES_PER_TOKEN = 8
_HEADER_BYTES_PER_SAMPLE = 64  # msgpack of one SampleMeta is ~20 bytes; generous
_HEADER_SLACK = 64 << 10


class _Redacted(msgspec.Struct, frozen=True):
    def __repr__(self) -> str:  # secret keys must never land in a log line or a traceback
        return f"{type(self).__name__}(<redacted>)"


class ServerKeys(_Redacted, frozen=True):
    """What the buffer holds: its own keypair and the client public keys each socket admits."""

    public: bytes
    secret: bytes
    ingest_clients: list[bytes]  # engines
    serve_clients: list[bytes]  # learner ranks


class ClientKeys(_Redacted, frozen=True):
    """What an engine or learner rank holds: its keypair and the buffer's public key."""

    server_public: bytes
    public: bytes
    secret: bytes


class RunKeys(_Redacted, frozen=True):
    """The keys of one run (z85 bytes, as `zmq.curve_keypair` makes them)."""

    server: ServerKeys
    engine: ClientKeys
    learner: ClientKeys


def make_run_keys() -> RunKeys:
    """Fresh CURVE keys for one run; a libzmq without CURVE is a one-line RunError."""
    if not zmq.has("curve"):
        raise RunError(
            "security.curve: this libzmq was built without CURVE (libsodium); install a pyzmq wheel "
            "that has it, or set security.curve=false on a trusted network"
        )
    server_pub, server_sec = zmq.curve_keypair()
    engine_pub, engine_sec = zmq.curve_keypair()
    learner_pub, learner_sec = zmq.curve_keypair()
    return RunKeys(
        server=ServerKeys(server_pub, server_sec, ingest_clients=[engine_pub], serve_clients=[learner_pub]),
        engine=ClientKeys(server_pub, engine_pub, engine_sec),
        learner=ClientKeys(server_pub, learner_pub, learner_sec),
    )


def warn_insecure(stream=sys.stderr) -> None:
    print(
        "warning: security.curve=false: the data plane is unencrypted and any peer that reaches the "
        "buffer's ports can inject trajectories or read batches",
        file=stream,
        flush=True,
    )


def frame_limit_bytes(max_frame_mb: int, group_size: int, max_model_len: int, extra_bytes_per_token: int = 0) -> int:
    """The largest trajectory frame the buffer accepts. 0 MiB = computed: one group of at most
    `group_size` samples (times the segments an agent episode may split into: see settings) of at most
    `max_model_len` tokens each (an id and a log-prob per token, and `extra_bytes_per_token`: a teacher's
    log-prob, an MoE model's routes: layers x top_k x 1-2 bytes) plus its header, rounded up to whole MiB."""
    if max_frame_mb > 0:
        return max_frame_mb << 20
    per_token = _BYTES_PER_TOKEN + extra_bytes_per_token
    need = group_size * (max_model_len * per_token + _HEADER_BYTES_PER_SAMPLE) + _HEADER_SLACK
    return -(-need // (1 << 20)) << 20


def harden_server(sock: zmq.Socket, keys: ServerKeys | None, domain: str, max_part_bytes: int) -> None:
    """Before bind: CURVE server with a ZAP domain (fail closed if no ZAP handler answers), and a
    per-part size cap: libzmq drops a larger part and disconnects its sender (who reconnects)."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_part_bytes)
    if keys is None:
        return
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def harden_client(sock: zmq.Socket, keys: ClientKeys | None) -> None:
    """Before connect: authenticate to the buffer and encrypt (no-op with CURVE off)."""
    sock.setsockopt(zmq.LINGER, 0)
    if keys is None:
        return
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


class AllowedKeys:
    """ZAP credentials check for one domain: admits exactly these client public keys."""

    def __init__(self, keys: list[bytes]) -> None:
        self._keys = frozenset(keys)

    def callback(self, domain: str, key: bytes) -> bool:  # called by pyzmq's Authenticator
        return key in self._keys


def start_authenticator(ctx: zmq.Context, keys: ServerKeys | None):
    """A ZAP handler in its own thread (None with CURVE off). Start it before binding.

    A thread rather than pyzmq's AsyncioAuthenticator: on the buffer's event loop the latter
    missed ZAP requests (a handshake after a refused no-CURVE peer hung in ~14 of 15 tries here),
    and a thread also answers while the loop is busy decoding a large frame."""
    if keys is None:
        return None
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(INGEST_DOMAIN, AllowedKeys(keys.ingest_clients))
    auth.configure_curve_callback(SERVE_DOMAIN, AllowedKeys(keys.serve_clients))
    return auth


class PeerEvents(msgspec.Struct):
    """What happened to connections on one listening socket (from its ZMQ monitor)."""

    handshakes: int = 0  # peers admitted (authenticated when CURVE is on)
    auth_denied: int = 0  # valid CURVE, but a client key this socket does not admit
    protocol_failed: int = 0  # no CURVE, the wrong server key, or garbage in the handshake
    disconnects: int = 0  # an admitted peer dropped: it left, or sent a part over the size cap


_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_DISCONNECTED
)


async def watch_peers(monitor: zmq.Socket, events: PeerEvents) -> None:
    """Count monitor events of one socket into `events` until cancelled (an asyncio monitor socket)."""
    # libzmq reports a failed handshake, then that connection's disconnect: the latter is not an
    # admitted peer leaving, so it is matched off against the failure instead of counted.
    failed_unmatched = 0
    while True:
        event = parse_monitor_message(await monitor.recv_multipart())["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            events.handshakes += 1
        elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            events.auth_denied += 1
            failed_unmatched += 1
        elif event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
            events.protocol_failed += 1
            failed_unmatched += 1
        elif event == zmq.EVENT_DISCONNECTED:
            if failed_unmatched:
                failed_unmatched -= 1
            else:
                events.disconnects += 1


def monitor_socket(sock: zmq.Socket) -> zmq.Socket:
    return sock.get_monitor_socket(_EVENTS)
