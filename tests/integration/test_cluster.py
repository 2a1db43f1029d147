"""ResourcePool and WorkerGroup on a real local Ray: ranks, rendezvous, typed fan-out."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from async_rl.cluster.resources import ResourcePool, WorkerGroup
from async_rl.errors import RunError

pytestmark = pytest.mark.integration


class EchoRank:
    def __init__(self, rank: int, world_size: int, master: str) -> None:
        self.rank = rank
        self.world_size = world_size
        self.master = master

    def rendezvous_address(self) -> str:
        self.master = f"127.0.0.1:{20000 + self.rank}"
        return self.master

    def identity(self) -> tuple[int, int, str]:
        return self.rank, self.world_size, self.master

    def total(self, shard: list[int]) -> int:
        return self.rank * 1000 + sum(shard)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=100 << 20,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).parent)}},  # actors import EchoRank
    )
    yield
    ray.shutdown()


def test_worker_group_ranks_rendezvous_and_sharded_calls(local_ray):
    pool = ResourcePool("echo", [{"CPU": 0.5}] * 3, strategy="PACK", timeout_s=60)
    try:
        world = len(pool)

        def make(rank, options, master):
            return ray.remote(EchoRank).options(**options).remote(rank, world, master)

        group = WorkerGroup(pool, make, lambda a: ray.get(a.rendezvous_address.remote()))
        # Rank 0 was made first and chose the address; every other rank was told it.
        assert group.call(lambda a: a.identity.remote()) == [
            (0, 3, "127.0.0.1:20000"),
            (1, 3, "127.0.0.1:20000"),
            (2, 3, "127.0.0.1:20000"),
        ]
        assert group.call_sharded(lambda a, s: a.total.remote(s), [[1, 2], [3], []]) == [3, 1003, 2000]
        with pytest.raises(ValueError, match="2 shards for 3 ranks"):
            group.call_sharded(lambda a, s: a.total.remote(s), [[1], [2]])
        group.kill()
    finally:
        pool.remove()


def test_unplaceable_pool_is_a_one_line_error(local_ray):
    with pytest.raises(RunError, match="resource pool 'huge'.*could not be placed"):
        ResourcePool("huge", [{"CPU": 64}], timeout_s=2)
