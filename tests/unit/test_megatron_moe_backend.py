"""The megatron backend on a Qwen3-MoE checkpoint with expert parallelism (two gloo ranks on CPU, EP=2):
learner.routing_replay auto replays the micro-batch's routes (`MicroBatch.routes`) in the scoring and
training passes, in megatron's token order for rows (sdpa: a block-diagonal mask) and for the packed
row (varlen); rows without a route take the live router and are counted; the metrics are reduced
over the data-parallel ranks. Starts torch.distributed (two gloo ranks on loopback)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from async_rl.cluster.net import free_port  # noqa: E402
from tests.unit._megatron_models import tiny_qwen3_moe  # noqa: E402
from tests.unit._megatron_moe_ranks import run_moe_backend_rank  # noqa: E402
from tests.unit._spawn_jobs import spawn_jobs  # noqa: E402

ATTENTIONS = ["sdpa", "varlen"]


@pytest.fixture(scope="module")
def attentions(tmp_path_factory) -> dict[str, dict[int, dict]]:
    """Both attentions' two ranks, from one spawn (each a job with a group of its own)."""
    model_dir = tmp_path_factory.mktemp("tiny-qwen3-moe")
    tiny_qwen3_moe().save_pretrained(model_dir)
    outs: dict[str, Path] = {a: tmp_path_factory.mktemp("megatron-moe-backend") for a in ATTENTIONS}
    spawn_jobs([(run_moe_backend_rank, (2, free_port(), str(model_dir), 2, a, str(out))) for a, out in outs.items()], 2)
    return {a: {r: torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)} for a, out in outs.items()}


@pytest.fixture(scope="module", params=ATTENTIONS)
def run(request, attentions):
    return request.param, attentions[request.param]


def test_the_layout_is_the_attentions(run):
    attention, ranks = run
    assert ranks[0]["packed_as"] == ("row" if attention == "varlen" else "mask")


def test_routed_tokens_run_their_routes_in_megatrons_token_order(run):
    _, ranks = run
    for r in ranks.values():
        routes, ran = r["routes"].long(), r["ran_replayed"]
        rows, cols = routes.shape[:2]
        if r["packed_as"] == "row":
            ran = ran.reshape(rows, cols, *ran.shape[1:])
        else:
            ran = ran.reshape(cols, rows, *ran.shape[1:]).transpose(0, 1)
        routed = routes[..., 0, 0] >= 0
        assert torch.equal(ran[routed], routes[routed])
        assert not torch.equal(ran[~routed], routes[~routed])  # those took the live router


def test_replay_changes_the_log_probs_and_replaying_the_live_routes_does_not(run):
    _, ranks = run
    for r in ranks.values():
        mask = r["loss_mask"].bool()
        assert (r["replayed"] - r["live"]).abs()[mask].max() > 1e-3
        assert torch.allclose(r["replayed_live"], r["live"], atol=1e-5, rtol=0)


def test_the_backend_states_the_routing_shape_and_replays_by_default(run):
    _, ranks = run
    for r in ranks.values():
        assert (r["moe"].layers, r["moe"].experts, r["moe"].top_k) == (2, 8, 2)
        assert r["replays_routes"]  # learner.routing_replay auto on an MoE model


def test_the_training_pass_reports_router_statistics_the_driver_tallies(run):
    """The gradient pass returns each forward's `RouterStats` in `TokenScores.router`; `RouterTally`
    reduces them over the data-parallel ranks into the same `MoeMetrics` as the torch backend's."""
    _, ranks = run
    m, own = ranks[0]["metrics"], ranks[0]["own_metrics"]
    assert m == ranks[1]["metrics"] and own == ranks[1]["own_metrics"]  # reduced over the two ranks
    tokens = int(ranks[0]["loss_mask"].shape[0] * ranks[0]["loss_mask"].shape[1])
    for metrics in (m, own):
        assert metrics.replay and metrics.unrouted_tokens == 2 * 3  # the rows without a route, on each rank
        assert metrics.routed_tokens <= 2 * tokens - 2 * 3
        assert metrics.expert_load_max_mean >= 1.0
    # the model's own routes: the live router agrees everywhere; random routes: mostly not
    assert own.router_agreement == 1.0 and own.router_agreement_worst_layer == 1.0
    assert 0.0 <= m.router_agreement < 0.5 and m.router_agreement <= m.router_agreement_worst_layer


def test_a_training_step_with_replay_moves_every_weight(run):
    _, ranks = run
    assert math.isfinite(ranks[0]["grad_norm"]) and ranks[0]["grad_norm"] > 0
    before, after = ranks[0]["before"], ranks[0]["after"]
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    assert not unchanged, unchanged[:4]
