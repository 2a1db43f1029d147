"""MoE models in the torch learner (learner/model/moe.py): rollout routing replay obeyed token by token in
every batch layout and under activation checkpointing, gradients reaching the router, the routing
metrics reported (not assumed), the experts' grouped GEMMs equal to HF's loop, one-line errors."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from async_rl.config import AlgorithmConfig, LoraConfig
from async_rl.errors import RunError
from async_rl.learner.batch.routes import ROUTE_LIVE
from async_rl.learner.driver import shard_samples
from async_rl.learner.model.moe import ROUTER_CLASSES, renormalises, routers
from async_rl.protocol import route_missing
from tests.unit._learner_fixtures import assert_equal_steps, groups, make_rank, spied_step
from tests.unit._moe_fixtures import SHAPE, experts_calls, random_routes, with_routes

LAYERS, TOP_K, EXPERTS = SHAPE.layers, SHAPE.top_k, SHAPE.experts
LAYOUTS = {
    "packed": {"packing": True, "share_prompt": False, "pack_row_tokens": 24},
    "padded": {"packing": False, "share_prompt": False},
    "shared_packed": {"packing": True, "share_prompt": True, "pack_row_tokens": 40},
    "shared_padded": {"packing": False, "share_prompt": True},
}


FAMILY_FIXTURE = {"qwen3_moe": "moe_model_dir", "qwen2_moe": "qwen2_moe_dir", "mixtral": "mixtral_moe_dir"}
# Every layout, plain and checkpointed, on Qwen3-MoE; two of them on Qwen2-MoE (its other router), one on
# Mixtral (the upcycled preset's class)
REPLAY_CASES = [("qwen3_moe", layout, ckpt) for layout in LAYOUTS for ckpt in (False, True)] + [
    ("qwen2_moe", "packed", True), ("qwen2_moe", "shared_padded", False), ("mixtral", "shared_packed", True)]


@pytest.fixture(params=list(FAMILY_FIXTURE))
def moe_dir(request):
    return request.getfixturevalue(FAMILY_FIXTURE[request.param])


def shard(seed: int = 0):
    return groups(seed, n_groups=3, group_size=3)


def as_engine_scored(model_dir, gs):
    """`gs` with the behaviour log-probs an engine on the same weights gives when it routes as recorded
    (the learner's replayed scores): the mismatch with replay is then ~0, the live router's is not."""
    engine = make_rank(model_dir, routing_replay="on")
    scores = iter(engine.compute_logprobs(gs, 1.0))
    for g in gs:
        g.logprobs = [next(scores) for _ in g.completions]
    return gs


@pytest.mark.parametrize(("family", "layout", "checkpointing"), REPLAY_CASES,
                         ids=[f"{f}-{lay}-{'checkpointed' if c else 'plain'}" for f, lay, c in REPLAY_CASES])
def test_replay_runs_the_recorded_experts_for_every_token(request, family, layout, checkpointing):
    moe_dir = request.getfixturevalue(FAMILY_FIXTURE[family])
    rank = make_rank(moe_dir, **LAYOUTS[layout], activation_checkpointing=checkpointing, micro_batch_tokens=30)
    gs = random_routes(shard(), LAYERS, TOP_K, EXPERTS, seed=1, missing_every=5)
    samples = shard_samples(gs, moe=rank.backend.moe)
    mbs = rank._micro_batches(samples)
    assert len(mbs) > 1
    calls, handles = experts_calls(rank.backend.model)
    router_weights = [r.weight for r in routers(rank.backend.model)]
    routed = 0
    for mb in mbs:
        calls.clear()
        rank.backend.forward_backward([mb], 1.0, lambda i, s, mb=mb: (s.logp * mb.loss_mask).sum())
        # every layer once, and once more in backward's recompute when checkpointed
        assert sorted(layer for layer, _ in calls) == sorted(list(range(LAYERS)) * (2 if checkpointing else 1))
        flat = mb.routes.reshape(-1, LAYERS, TOP_K)
        for layer, ran in calls:
            has = flat[:, layer, 0] >= 0
            assert torch.equal(ran[has], flat[has, layer].long())
        routed += int((flat[:, 0, 0] >= 0).sum())
        assert all(w.grad is not None and float(w.grad.abs().sum()) > 0 for w in router_weights)  # the router learns
    for h in handles:
        h.remove()
    recorded = sum(int((r != route_missing(r.dtype)).all(axis=(1, 2)).sum()) for g in gs for r in g.routes)
    if "shared" in layout:
        assert 0 < routed < recorded  # a group's prompt rows once per block
    else:
        assert routed == recorded  # every recorded row replayed, none more


@pytest.mark.parametrize("layout", ["packed", "shared_packed", "padded"])
def test_a_tokens_route_sits_where_the_layout_puts_the_token(moe_model_dir, layout):
    rank = make_rank(moe_model_dir, **LAYOUTS[layout])
    gs = random_routes(shard(), LAYERS, TOP_K, EXPERTS, seed=2)
    samples = shard_samples(gs, moe=rank.backend.moe)
    at = 0  # the spans follow the samples' order across the micro-batches
    for mb in rank._micro_batches(samples):
        for row, first, n in mb.spans:
            s = samples[at]
            at += 1
            # column `first` holds the last prompt token; the completion's tokens follow, the last one live
            for k in range(n):
                assert int(mb.input_ids[row, first + k]) == int(s.tokens[s.start - 1 + k])
                assert torch.equal(mb.routes[row, first + k], torch.from_numpy(s.routes[s.start - 1 + k].astype(np.int32)))
            assert bool((mb.routes[row, first + n] == ROUTE_LIVE).all())
    assert at == len(samples)


def test_replaying_the_models_own_routes_is_the_live_forward(moe_dir):
    """The engine's routes on the same weights: replay changes nothing, log-probs and gradients alike
    (the weights are gathered from the live softmax exactly where top-k took them)."""
    live = make_rank(moe_dir, routing_replay="off")
    replay = make_rank(moe_dir, routing_replay="on")
    gs = with_routes(live.backend.model, shard())
    a, b = spied_step(live, gs), spied_step(replay, gs)
    assert_equal_steps(a, b)
    assert a["metrics"].moe.router_agreement == 1.0 and b["metrics"].moe.router_agreement == 1.0
    assert not a["metrics"].moe.replay and b["metrics"].moe.replay


def test_replay_is_obeyed_in_the_no_grad_passes(moe_model_dir):
    """The decoupled objective's proximal pass (no grad, padded shard) routes as the training forward."""
    rank = make_rank(moe_model_dir, algorithm=AlgorithmConfig(objective="decoupled"))
    gs = random_routes(shard(), LAYERS, TOP_K, EXPERTS, seed=3)
    out = spied_step(rank, gs)
    prox, _ = out["scored"]
    trained = [x for x in out["logp"]]
    row = 0
    for g in gs:
        start = len(g.prompt_tokens) - 1
        for c in g.completions:
            np.testing.assert_allclose(prox[row, start : start + len(c)].numpy(), trained[row], atol=1e-5)
            row += 1


def test_metrics_report_agreement_mismatch_load_and_fallback(moe_model_dir):
    rank = make_rank(moe_model_dir, routing_probe_samples=4)
    own = with_routes(rank.backend.model, shard(4))
    m = rank.train_on_shard(0, own).moe
    assert m.router_agreement == 1.0 and m.router_agreement_worst_layer == 1.0
    assert m.mismatch_replay == pytest.approx(m.mismatch_live, abs=1e-6)  # replaying the live choice
    assert m.unrouted_tokens == 0

    rank = make_rank(moe_model_dir, routing_probe_samples=4)
    gs = as_engine_scored(moe_model_dir, random_routes(shard(4), LAYERS, TOP_K, EXPERTS, seed=5, missing_every=4))
    m = rank.train_on_shard(0, gs).moe
    missing = sum(len(range(0, len(r), 4)) for g in gs for r in g.routes)
    assert m.unrouted_tokens == missing  # counted, and left to the live router
    assert m.routed_tokens > 0 and m.router_agreement is not None
    assert 0.0 <= m.router_agreement < 0.5  # random routes: the live router rarely agrees in both layers
    assert m.router_agreement <= m.router_agreement_worst_layer < 1.0
    assert m.mismatch_replay < 1e-5 < 1e-3 < m.mismatch_live  # the engine's routing, and the live router's
    assert m.expert_load_max_mean >= 1.0
    assert m.aux_loss == 0.0  # not asked


def test_with_replay_off_the_agreement_and_mismatch_are_measured(moe_model_dir):
    rank = make_rank(moe_model_dir, routing_replay="off", routing_probe_samples=4)
    gs = as_engine_scored(moe_model_dir, random_routes(shard(4), LAYERS, TOP_K, EXPERTS, seed=5))
    metrics = rank.train_on_shard(0, gs)
    m = metrics.moe
    assert not m.replay and m.routed_tokens > 0
    assert 0.0 <= m.router_agreement < 0.5
    assert m.mismatch_replay < 1e-5 < 1e-3 < m.mismatch_live
    # the training pass ran the live router: it sees the live mismatch over every token
    assert metrics.logprob_abs_diff > 1e-3


def test_expert_load_is_the_busiest_experts_share(moe_model_dir):
    """Every recorded row to experts 0 and 1: expert 0 takes about every token of a layer, E / K x the mean."""
    gs = random_routes(shard(11), LAYERS, TOP_K, EXPERTS, seed=11)
    for g in gs:
        for r in g.routes:
            r[..., 0], r[..., 1] = 0, 1
    m = make_rank(moe_model_dir).train_on_shard(0, gs).moe
    assert EXPERTS / TOP_K * 0.8 < m.expert_load_max_mean <= EXPERTS / TOP_K  # the live last tokens go elsewhere


def test_samples_without_routes_take_the_live_router_and_are_counted(moe_model_dir):
    rank = make_rank(moe_model_dir)
    gs = shard(6)
    m = rank.train_on_shard(0, gs).moe
    assert m.routed_tokens == 0 and m.router_agreement is None
    assert m.unrouted_tokens == sum(len(g.prompt_tokens) + len(c) - 1 for g in gs for c in g.completions)


def test_load_balancing_loss_reaches_the_router(moe_model_dir):
    gs = random_routes(shard(7), LAYERS, TOP_K, EXPERTS, seed=7)
    plain = spied_step(make_rank(moe_model_dir), gs)
    aux = spied_step(make_rank(moe_model_dir, moe_aux_loss_coef=1.0), gs)
    assert plain["metrics"].moe.aux_loss == 0.0
    assert aux["metrics"].moe.aux_loss > 0.5  # about top_k when balanced
    name = next(n for n in plain["grads"] if n.endswith("mlp.gate.weight"))
    assert float((aux["grads"][name] - plain["grads"][name]).abs().max()) > 1e-6
    # the final norm feeds no router: its gradient is the policy loss's alone
    torch.testing.assert_close(aux["grads"]["model.norm.weight"], plain["grads"]["model.norm.weight"])


def test_grouped_experts_equal_hf_loop(moe_dir):
    gs = random_routes(shard(8), LAYERS, TOP_K, EXPERTS, seed=8)
    loop = make_rank(moe_dir, moe_experts="eager")
    grouped = make_rank(moe_dir, moe_experts="auto")
    assert grouped.backend.experts_kernel == "grouped_mm"
    assert_equal_steps(spied_step(loop, gs), spied_step(grouped, gs))


def test_routers_of_the_installed_transformers_are_the_ones_replay_reproduces():
    """Each known router returns (logits, scores, indices), scores the softmax at the indices (renormalised
    where it normalises): what replay gathers."""
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    pairs = [(Qwen3MoeTopKRouter, Qwen3MoeConfig), (Qwen2MoeTopKRouter, Qwen2MoeConfig), (OlmoeTopKRouter, OlmoeConfig)]
    assert sorted([cls.__name__ for cls, _ in pairs] + [MixtralTopKRouter.__name__]) == sorted(ROUTER_CLASSES)
    torch.manual_seed(0)
    made = [
        cls(config_cls(hidden_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm))
        for cls, config_cls in pairs
        for norm in (True, False)
    ] + [MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=2))]
    for r in made:
        torch.nn.init.normal_(r.weight)
        logits, scores, indices = r(torch.randn(5, 16))
        picked = torch.softmax(logits, -1, dtype=torch.float).gather(1, indices)
        if renormalises(r):
            picked = picked / picked.sum(-1, keepdim=True)
        torch.testing.assert_close(scores.float(), picked)
    assert [renormalises(r) for r in made] == [True, False] * 3 + [True]


def test_bad_settings_and_routes_are_one_line_errors(model_dir, moe_model_dir):
    with pytest.raises(RunError, match=r"routing_replay=on: the model is dense") as e:
        make_rank(model_dir, routing_replay="on")
    assert "\n" not in str(e.value)
    with pytest.raises(RunError, match=r"learner.lora: not with an MoE model") as e:
        make_rank(moe_model_dir, lora=LoraConfig(enabled=True, rank=4))
    rank = make_rank(moe_model_dir)
    wrong_layers = random_routes(shard(9), LAYERS + 1, TOP_K, EXPERTS, seed=9)
    with pytest.raises(RunError, match=r"prompt 0 \(engine 0\) sample 0: routes of shape .* 2 MoE layers, top-2") as e:
        rank.train_on_shard(0, wrong_layers)
    assert "\n" not in str(e.value)
    gs = random_routes(shard(9), LAYERS, TOP_K, EXPERTS, seed=9)
    gs[1].routes[2][0, 0, 0] = EXPERTS + 3
    with pytest.raises(RunError, match=r"prompt 1 \(engine 0\) sample 2: routes name expert 11, the model has 8"):
        rank.train_on_shard(0, gs)
    assert make_rank(model_dir).backend.moe is None  # a dense model: auto is off, nothing hooked


def test_the_kl_reference_replays_the_routes_too(moe_model_dir):
    """Before the first update the reference (the initial weights) is the policy: a zero KL only when
    both route every token alike; with random routes the live reference would differ."""
    gs = random_routes(shard(10), LAYERS, TOP_K, EXPERTS, seed=10)
    rank = make_rank(moe_model_dir, algorithm=AlgorithmConfig(kl_coef=0.1))
    assert rank.algo.reference.router_replay is not None
    assert rank.train_on_shard(0, gs).kl_ref == pytest.approx(0.0, abs=1e-6)
    live_ref = make_rank(moe_model_dir, algorithm=AlgorithmConfig(kl_coef=0.1))
    live_ref.algo.reference.router_replay.remove()
    live_ref.algo.reference.router_replay = None
    # ten times the replayed bound above (the live reference's KL on these routes: ~8e-5)
    assert live_ref.train_on_shard(0, random_routes(shard(10), LAYERS, TOP_K, EXPERTS, seed=10)).kl_ref > 1e-5


def test_moe_metrics_reach_the_record_and_the_console_line():
    from async_rl.control.controller import moe_fields
    from async_rl.control.metrics import StepRecord, console_line
    from async_rl.learner.base import MoeMetrics

    required = {f.name: 0 for f in msgspec.structs.fields(StepRecord) if f.required}
    dense = StepRecord(**{**required, "accounting_balanced": True, "logprob_mismatch": None, **moe_fields(None)})
    assert dense.router_agreement is None and "moe" not in console_line(dense, 10)
    m = MoeMetrics(replay=True, routed_tokens=90, unrouted_tokens=7, router_agreement=0.9,
                   router_agreement_worst_layer=0.95, worst_layer=1, expert_load_max_mean=1.5,
                   mismatch_replay=1e-6, mismatch_live=2e-3)
    r = StepRecord(**{**required, "accounting_balanced": True, "logprob_mismatch": None, **moe_fields(m)})
    assert (r.router_agreement, r.router_worst_layer, r.moe_unrouted_tokens) == (0.9, 1, 7)
    line = console_line(r, 10)
    assert "moe replay on agree 90.0% worst 95.0% (layer 1) load max/mean 1.50 unrouted 7" in line
    assert "mismatch replay 1.0e-06 live 2.0e-03" in line
    assert b'"router_agreement":0.9' in msgspec.json.encode(r)


def test_the_sync_probe_scores_with_the_live_router(moe_model_dir):
    """After a sync the engine scores the probe with its live router on the new weights: the learner's side
    of the probe does too, not the batch's recorded routes (an older policy's choices: with them the
    probe of a tiny-qwen3-moe run read 8.6e-3 where the weights were equal)."""
    import dataclasses

    gs = random_routes(shard(11), LAYERS, TOP_K, EXPERTS, seed=11)
    rank = make_rank(moe_model_dir, routing_replay="on")
    rank.train_on_shard(0, gs)
    probe = rank.probe_logprobs(4)
    live = rank.compute_logprobs([dataclasses.replace(g, routes=None) for g in gs], 1.0)[:4]
    replayed = rank.compute_logprobs(gs, 1.0)[:4]
    for got, want in zip(probe.logprobs, live, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)
    assert max(float(np.abs(np.asarray(p) - r).max()) for p, r in zip(probe.logprobs, replayed, strict=True)) > 1e-4
