"""The learner group's rendezvous (learner/rendezvous.py): rank 0's store holds its port from the moment
the address is handed out, and the ranks form a working gloo group through it."""

from __future__ import annotations

import errno
import multiprocessing as mp
import socket

import pytest

from async_rl.learner.rendezvous import host_store


def test_the_hosted_store_holds_its_port_already():
    store = host_store("127.0.0.1", 2)
    with socket.socket() as s, pytest.raises(OSError) as taken:
        s.bind(("127.0.0.1", store.port))
    assert store.port > 0 and taken.value.errno == errno.EADDRINUSE


def _rank0(ports: mp.Queue, sums: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from async_rl.learner.rendezvous import host_store, join_group

    store = host_store("127.0.0.1", 2)
    ports.put(store.port)
    join_group("gloo", f"127.0.0.1:{store.port}", 0, 2, store)
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    sums.put(float(t))
    dist.destroy_process_group()


def _rank1(master: str, sums: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from async_rl.learner.rendezvous import join_group

    join_group("gloo", master, 1, 2)
    t = torch.tensor([2.0])
    dist.all_reduce(t)
    sums.put(float(t))
    dist.destroy_process_group()


def test_two_ranks_form_a_group_through_rank_zeros_store():
    ctx = mp.get_context("spawn")
    ports, sums = ctx.Queue(), ctx.Queue()
    first = ctx.Process(target=_rank0, args=(ports, sums))
    first.start()
    second = ctx.Process(target=_rank1, args=(f"127.0.0.1:{ports.get(timeout=120)}", sums))
    second.start()
    try:
        assert [sums.get(timeout=120), sums.get(timeout=120)] == [3.0, 3.0]
    finally:
        for p in (first, second):
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert (first.exitcode, second.exitcode) == (0, 0)
