"""free_port: the port a test or benchmark names for the ranks it spawns is drawn where the kernel never
hands out a port by itself, so no other process's outgoing connection or bind to port 0 takes it before
the rank binds it (the EADDRINUSE of a CI run)."""

from __future__ import annotations

import socket

import pytest

from async_rl.cluster import net


def test_a_free_port_is_below_the_ephemeral_range_and_binds():
    ephemeral = net._ephemeral_start()
    ports = {net.free_port() for _ in range(50)}
    assert all(20000 <= p < min(32768, ephemeral) for p in ports), sorted(ports)
    assert len(ports) > 40  # drawn at random, not handed out in order
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_a_port_someone_listens_on_is_drawn_again(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        draws = iter([busy, busy, 25000])
        monkeypatch.setattr(net.random.SystemRandom, "randrange", lambda self, lo, hi: next(draws))
        assert net.free_port() == 25000


def test_an_ephemeral_range_that_starts_low_leaves_the_kernels_pick(monkeypatch):
    monkeypatch.setattr(net, "_ephemeral_start", lambda: 20500)
    with socket.socket() as s:
        s.bind(("127.0.0.1", net.free_port()))


def test_no_port_at_all_is_an_error_not_port_0(monkeypatch):
    monkeypatch.setattr(net, "_ephemeral_start", lambda: 20500)
    monkeypatch.setattr(net, "_bind_once", lambda host, port: None)
    with pytest.raises(RuntimeError, match="no free TCP port on 127.0.0.1"):
        net.free_port()
