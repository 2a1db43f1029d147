"""Socket helpers every process needs, Ray or not: a free port, the address peers connect to.

Kept apart from `resources.py` (Ray placement groups) so that the learner, the weight-sync channels
and the buffer import without Ray: a bare GPU box (part A of `make test-gpu`) has none.
"""

from __future__ import annotations

import random
import socket
import sys
from pathlib import Path

ALL_INTERFACES = "0.0.0.0"
# free_port's draw: above Ray's worker ports (10002-19999), below the kernel's ephemeral range
_PICKED_PORTS = range(20000, 32768)
_ROUTE_PROBE = ("10.255.255.255", 9)  # any non-local address: a UDP connect only picks the route, sends nothing


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at this moment, for a caller that binds it soon after: tests and
    benchmarks that spawn their own ranks (a run's own processes bind port 0 and pass on what they got).

    Drawn at random below the kernel's ephemeral range and above Ray's worker ports. A port the kernel
    picked (a bind to port 0) is one it hands to the next outgoing connection or bind to 0 of any
    process, so between this call and the caller's bind another test's gloo pair or TCPStore client
    could take it (EADDRINUSE in a CI run). No process is given a port from this range without naming
    it; only another caller of this function, choosing among ~12,000, could."""
    high = min(_PICKED_PORTS.stop, _ephemeral_start())
    if high - _PICKED_PORTS.start < 1000:  # an ephemeral range that starts low: the kernel's pick is all there is
        if port := _bind_once(host, 0):
            return port
        raise RuntimeError(f"no free TCP port on {host}: even a bind to port 0 failed")
    rng = random.SystemRandom()
    for _ in range(64):
        if port := _bind_once(host, rng.randrange(_PICKED_PORTS.start, high)):
            return port
    raise RuntimeError(f"no free TCP port on {host} in {_PICKED_PORTS.start}-{high - 1} after 64 draws")


def _bind_once(host: str, port: int) -> int | None:
    """The port a socket bound to (`port`, or the kernel's pick for 0) and let go; None if it was taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return None
        return s.getsockname()[1]


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def node_ip() -> str:
    """This node's address for peers on other nodes. Inside a Ray process (Ray already imported and
    connected: the actors of a run) it is the address Ray registered the node under, which
    `ray start --node-ip-address` may have chosen; elsewhere the source address of the default route
    (loopback when the machine has no route at all)."""
    ray = sys.modules.get("ray")  # never imported here: a process that is not a Ray actor has no Ray address
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(_ROUTE_PROBE)
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def advertised_host(host: str) -> str:
    """The address peers connect to: a socket bound to every interface is reached at this node's IP."""
    return node_ip() if host == ALL_INTERFACES else host
