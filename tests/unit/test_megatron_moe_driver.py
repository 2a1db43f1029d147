"""The learner driver with learner.backend=megatron on a tiny Qwen3-MoE (one gloo rank on CPU): the groups'
recorded routes reach megatron's routers through `MicroBatch.routes` and are replayed, and the step's
`MoeMetrics` mean what the torch backend's do (tests/unit/test_moe_replay.py): agreement 1.0 on the model's
own routes, far below on random ones, the rows without a route counted, the mismatch probe with replay on
and off. With two pipeline stages (one MoE layer each) the stages' counts are joined: both stages report
what one stage reports. Starts torch.distributed (in spawned processes)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from async_rl.cluster.net import free_port  # noqa: E402
from tests.unit._megatron_moe_ranks import run_moe_driver_rank  # noqa: E402


def run_ranks(model_dir: Path, out: Path, pp: int) -> list[dict]:
    import torch.multiprocessing as mp

    mp.spawn(run_moe_driver_rank, args=(pp, free_port(), str(model_dir), str(out), pp), nprocs=pp, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(pp)]


@pytest.fixture(scope="module")
def steps(moe_model_dir, tmp_path_factory):
    return run_ranks(moe_model_dir, tmp_path_factory.mktemp("megatron-moe-driver"), 1)[0]


@pytest.fixture(scope="module")
def stages(moe_model_dir, tmp_path_factory):
    """The same three steps with two pipeline stages: layer 0 on rank 0, layer 1 on rank 1."""
    return run_ranks(moe_model_dir, tmp_path_factory.mktemp("megatron-moe-driver-pp2"), 2)


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


def test_the_all_layer_agreement_needs_every_layer_to_agree(steps):
    m = steps["mixed"]  # layer 0 disagrees on every 2nd row, layer 1 on every 3rd
    assert m.unrouted_tokens == 0 and m.routed_tokens > 0
    assert 0.0 < m.router_agreement < m.router_agreement_worst_layer < 1.0


def test_two_pipeline_stages_join_their_layers_counts_into_the_one_stage_metrics(steps, stages):
    """Each stage routes the same tokens through its own layer: a token agrees in every layer only if
    it agrees in both stages (before, a stage held only its layer's counts and no agreement was reported).
    `mixed` tells the join apart from either stage's own flags and from any-stage-agrees."""
    for rank in stages:
        assert rank["own"] == steps["own"] and rank["mixed"].router_agreement == steps["mixed"].router_agreement
        assert rank["mixed"].router_agreement_worst_layer == steps["mixed"].router_agreement_worst_layer
        assert rank["mixed"].worst_layer == steps["mixed"].worst_layer
        assert rank["mixed"].expert_load_max_mean == steps["mixed"].expert_load_max_mean
        # After a training step in each layout (fp32; the sums' order differs, so a near-tie may flip a token)
        randomly, one = rank["random"], steps["random"]
        assert randomly.routed_tokens == one.routed_tokens
        assert randomly.router_agreement == pytest.approx(one.router_agreement, abs=0.02)
        assert randomly.router_agreement_worst_layer == pytest.approx(one.router_agreement_worst_layer, abs=0.02)
        assert randomly.expert_load_max_mean == pytest.approx(one.expert_load_max_mean, rel=0.05)
    # The samples' own counts come from one rank of each replica (the first stage), as samples and tokens do.
    first, last = stages[0]["random"], stages[1]["random"]
    assert first.unrouted_tokens == steps["random"].unrouted_tokens > 0 and last.unrouted_tokens == 0
    assert msgspec.structs.replace(last, unrouted_tokens=first.unrouted_tokens) == first
    assert stages[0]["mixed"] == stages[1]["mixed"]
