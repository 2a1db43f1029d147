"""The learner driver with learner.backend=megatron on a tiny Qwen3-MoE (one gloo rank on CPU): the groups'
recorded routes reach megatron's routers through `MicroBatch.routes` and are replayed, and the step's
`MoeMetrics` mean what the torch backend's do (tests/unit/test_moe_replay.py): agreement 1.0 on the model's
own routes, far below on random ones, the rows without a route counted, the mismatch probe with replay on
and off. Starts torch.distributed (in a spawned process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from async_rl.cluster.net import free_port  # noqa: E402
from tests.unit._megatron_moe_ranks import run_moe_driver_rank  # noqa: E402


@pytest.fixture(scope="module")
def steps(moe_model_dir, tmp_path_factory):
    import torch.multiprocessing as mp

    out: Path = tmp_path_factory.mktemp("megatron-moe-driver")
    mp.spawn(run_moe_driver_rank, args=(1, free_port(), str(moe_model_dir), str(out)), nprocs=1, join=True)
    return torch.load(out / "rank0.pt", weights_only=False)


def test_the_backend_states_the_models_routing_shape(steps):
    assert steps["moe"] == (2, 8, 2)  # what check_shard_routes and the tally read


def test_the_models_own_routes_agree_everywhere_and_replay_changes_nothing(steps):
    m = steps["own"]
    assert m.replay and m.unrouted_tokens == 0 and m.routed_tokens > 0
    assert m.router_agreement == 1.0 and m.router_agreement_worst_layer == 1.0
    assert m.mismatch_replay == pytest.approx(m.mismatch_live, abs=1e-6)  # replaying the live choice
    assert m.expert_load_max_mean >= 1.0 and m.aux_loss == 0.0


def test_random_routes_are_replayed_disagree_and_rows_without_one_are_counted(steps):
    m = steps["random"]
    assert m.unrouted_tokens == steps["missing"] > 0  # counted, and left to the live router
    assert 0.0 <= m.router_agreement < 0.5  # the live router rarely picks a random pair in both layers
    assert m.router_agreement <= m.router_agreement_worst_layer < 1.0
    assert abs(m.mismatch_replay - m.mismatch_live) > 1e-3  # the replayed routes change the log-probs
