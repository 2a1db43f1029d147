"""A real multi-host Ray cluster on this machine (scripts/multihost_demo.py): three hosts made of
network namespaces, engines on one, learner and buffer on another; weights over gloo and
trajectories over ZMQ with CURVE between their IPs; then the engine host's raylet is SIGKILLed and
the run must replace the engine on the spare host and finish. Runs where network namespaces can be
made (root with iproute2, as in CI); skipped with the reason otherwise. Leaves nothing behind."""

from __future__ import annotations

import importlib.util
import ipaddress
import signal
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
STEPS = 60
_spec = importlib.util.spec_from_file_location("multihost_demo", REPO / "scripts" / "multihost_demo.py")
demo = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = demo  # its dataclasses look their module up
_spec.loader.exec_module(demo)


@pytest.fixture(scope="module")
def namespaces():
    why = demo.can_make_namespaces()  # tried for real: root alone is not enough in some containers
    if why:
        pytest.skip(why)
    # A SIGTERM (timeout, CI cancel) unwinds through the demo's cleanup instead of leaving namespaces.
    previous = signal.signal(signal.SIGTERM, demo._exit_on_sigterm)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_engines_learner_on_different_hosts_survive_a_host_failure(namespaces, tmp_path, model_cache):
    args = demo.parse_args(
        # Tiny steps (~0.2 s): the engine host's processes outlive its raylet by ~2 s and Ray marks the
        # node dead after ~3 s, so the run needs steps enough to still be going when the replacement starts.
        [
            "--out",
            str(tmp_path),
            "--steps",
            str(STEPS),
            "--kill-after",
            "2",
            "--timeout-s",
            "480",
            f"model.cache_dir={model_cache}",
        ]
    )
    s = demo.run_demo(args)
    assert s.leftovers == [], s.leftovers  # namespaces, veths, Ray's temp folder: all gone
    assert s.exit_code == 0, s.error_line
    assert s.steps_done == STEPS

    # Before the failure: learner, buffer and controller on the head, the engine on a generator host.
    before = s.roles_before_kill
    assert {"learner", "buffer", "controller"} <= set(before["head"]), before
    assert s.killed_host in ("gen-a", "gen-b") and "engine" in before[s.killed_host], before
    assert "learner" not in before[s.killed_host]

    # Both planes crossed hosts on their non-loopback IPs: trajectories engine -> buffer (ZMQ, CURVE)
    # and weights learner -> vLLM worker (gloo).
    def crossed(a: str, b: str) -> list:
        return [c for c in s.connections if {c.src_role, c.dst_role} == {a, b}]

    for a, b in (("engine", "buffer"), ("learner", "vllm worker")):
        found = crossed(a, b)
        assert found, (a, b, s.connections)
        for c in found:
            hosts = {c.src.rsplit(":", 1)[0], c.dst.rsplit(":", 1)[0]}
            assert hosts == {s.hosts["head"], s.hosts[s.killed_host]}
            assert not any(ipaddress.ip_address(h).is_loopback for h in hosts)
    run_config = yaml.safe_load((tmp_path / "runs" / "run" / "config.yaml").read_text())
    assert run_config["security"]["curve"] is True
    assert run_config["weight_sync"]["backend"] == "gloo"

    # After the raylet died: the engine was replaced on the surviving generator host and trained on.
    spare = "gen-b" if s.killed_host == "gen-a" else "gen-a"
    assert s.replaced_on == spare, (s.replaced_on, s.roles_after_recovery, s.recovery_events)
    assert any("died" in e for e in s.recovery_events) and any(
        "started engine" in e for e in s.recovery_events
    )
