"""Socket helpers every process needs, Ray or not: a free port, the address peers connect to.

Kept apart from `resources.py` (Ray placement groups) so that the learner, the weight-sync channels
and the buffer import without Ray: a bare GPU box (part A of `make test-gpu`) has none.
"""

from __future__ import annotations

import socket
import sys

ALL_INTERFACES = "0.0.0.0"
_ROUTE_PROBE = ("10.255.255.255", 9)  # any non-local address: a UDP connect only picks the route, sends nothing


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at this moment (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
