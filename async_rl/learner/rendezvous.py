"""The learner ranks' default process group, joined through a TCP store that rank 0 hosts.

`init_method="tcp://host:port"` needs a port found free by one call and bound by a later one; in
between any process on the node may take it (two runs on one machine, as the parallel test suite
runs them; a ZMQ socket bound to a random port). Rank 0 instead starts the store on port 0 when it
is asked for the address (`LearnerRank.rendezvous_address`): the kernel picks a free port and binds
it in the same call. Rank 0 keeps the store and joins the group through it; the others connect to
the port it got.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

TIMEOUT = timedelta(seconds=300)  # every rank's wait for the others, at the rendezvous and in collectives


def host_store(host: str, world_size: int) -> dist.TCPStore:
    """Rank 0: the group's store, listening on a port the kernel picked (`.port`)."""
    return dist.TCPStore(host, 0, world_size, is_master=True, timeout=TIMEOUT, wait_for_workers=False)


def join_group(backend: str, master: str, rank: int, world_size: int, hosted: dist.TCPStore | None = None) -> None:
    """Join the default process group whose store is at `master` ('host:port'): through `hosted`
    (rank 0's own store from `host_store`) where given; else rank 0 starts the store on that port and
    the others connect to it (a caller that chose the port itself: tests that spawn their ranks)."""
    host, port = master.rsplit(":", 1)
    store = hosted or dist.TCPStore(
        host, int(port), world_size, is_master=rank == 0, timeout=TIMEOUT, wait_for_workers=False
    )
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=TIMEOUT)
