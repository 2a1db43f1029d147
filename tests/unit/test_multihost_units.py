"""What a multi-node run needs from the pure logic: published addresses, placement, pinning. No Ray."""

from __future__ import annotations

import os
from pathlib import Path

import ray
import torch

from async_rl.cluster.placement import plan_placement
from async_rl.config import WeightSyncConfig, load_config
from async_rl.control import settings
from async_rl.generator.pool import GeneratorPool
from async_rl.learner.weight_source import WeightSource
from async_rl.serving import cpu_threads
from async_rl.weight_sync.gloo import local_address_towards


def sync_config(host: str) -> WeightSyncConfig:
    return WeightSyncConfig(backend="gloo", bucket_mb=1, host=host, timeout_s=10.0)


def cfg(*overrides: str):
    return load_config(None, list(overrides))


def test_weight_source_publishes_the_node_ip_for_every_interface(tmp_path):
    source = WeightSource(sync_config("0.0.0.0"), lambda: {"w": torch.zeros(4)})
    try:
        info = source.open(world_size=2)
    finally:
        source.close()
    # Receivers connect to what is published: never the wildcard, the node's own address instead.
    assert info.host == ray.util.get_node_ip_address()
    assert info.host != "0.0.0.0"


def test_weight_source_publishes_an_explicit_host_as_given(tmp_path):
    source = WeightSource(sync_config("127.0.0.1"), lambda: {"w": torch.zeros(4)})
    try:
        assert source.open(world_size=2).host == "127.0.0.1"
    finally:
        source.close()


def test_gloo_binds_on_the_route_to_the_rendezvous():
    assert local_address_towards("127.0.0.1") == "127.0.0.1"
    node_ip = ray.util.get_node_ip_address()
    assert local_address_towards(node_ip) == node_ip  # its own address is reached from itself


def test_engines_beyond_the_launch_plan_are_not_pinned():
    c = cfg("generators.num_engines=2", "generators.cpus_per_engine=2")
    plan = plan_placement(c, cores=[0, 1, 2, 3, 4, 5])
    planned = settings.engine_settings(c, "r", Path("/m"), plan, 1, "tcp://x:1", None)
    added = settings.engine_settings(c, "r", Path("/m"), plan, 2, "tcp://x:1", None)
    assert planned.cores == [2, 3]
    # A replacement or added engine may land on another node: no core ids from this machine.
    assert added.cores == [] and added.threads == 2


def test_on_a_ray_cluster_nothing_is_pinned():
    plan = plan_placement(cfg("ray.address=10.0.0.1:6379", "generators.num_engines=2"), cores=[0, 1])
    assert plan.cluster
    assert [p.cores for p in [*plan.engines, *plan.learner_ranks]] == [[], [], []]
    text = plan.render()
    assert "Ray cluster" in text and "engine 1" in text and "learner rank 0" in text
    assert "cores 0" not in text


def test_unbound_engine_runs_its_share_of_threads_unpinned(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    cpu_threads.leave_engine_unbound(4, tensor_parallel_size=2)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert os.environ["OMP_NUM_THREADS"] == "2"


def test_ray_resources_choose_nodes_for_engines_and_learner():
    c = cfg("generators.ray_resources={generator_host: 1}", "learner.ray_resources={learner_host: 0.5}")
    assert c.generators.ray_resources == {"generator_host": 1.0}
    assert c.learner.ray_resources == {"learner_host": 0.5}
    pool = GeneratorPool(lambda i: None, None, 2, 1, 10.0, c.generators.ray_resources)
    assert pool.bundle == {"CPU": 2, "generator_host": 1.0}
    assert cfg().generators.ray_resources == {} and cfg().learner.ray_resources == {}

