"""Megatron MoE with tensor and expert parallelism on CPU: two gloo ranks (spawned processes), the
all-gather token dispatcher (megatron's all-to-all one runs on CUDA only: `megatron.model.moe_config`).

Layouts: TP=2 (the experts split over the two TP ranks too), EP=2 (each rank holds four of the eight
experts whole; the attention is data-parallel), TP=2 with EP=2 (attention split over TP, experts over
EP: megatron's expert grid on the same two ranks), PP=2 (a stage's routers take its layers' routes);
Qwen2-MoE (shared expert, sigmoid gate) with TP=2 and EP=2. For each: the log-probs of a fixed batch equal
HF's (fp32), with the live router and with forced routes replayed (HF forced onto the same routes),
the experts megatron ran equal the forced ones for every token, the weights gathered under HF names
are HF's bit for bit, and one optimizer step changes every weight, the HF model loaded with them
giving the log-probs megatron gives.

Starts torch.distributed (two gloo ranks on loopback).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from async_rl.cluster.net import free_port  # noqa: E402
from async_rl.learner.rl.algorithms import token_logprobs  # noqa: E402
from tests.unit._megatron_models import hf_routes, tiny_moe  # noqa: E402
from tests.unit._megatron_moe_ranks import run_moe_rank  # noqa: E402
from tests.unit._spawn_jobs import spawn_jobs  # noqa: E402

LAYOUTS = [
    pytest.param(("qwen3_moe", 2, 1, 1), id="tp2"),
    pytest.param(("qwen3_moe", 1, 2, 1), id="ep2"),
    pytest.param(("qwen3_moe", 2, 2, 1), id="tp2-ep2"),
    pytest.param(("qwen3_moe", 1, 1, 2), id="pp2"),
    pytest.param(("qwen2_moe", 2, 2, 1), id="qwen2_moe-tp2-ep2"),  # the shared expert and its gate under TP
]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[tuple, dict[int, dict]]:
    """Every layout's two ranks, from one spawn (each layout a job with a group of its own)."""
    outs: dict[tuple, Path] = {p.values[0]: tmp_path_factory.mktemp("megatron-moe") for p in LAYOUTS}
    spawn_jobs([(run_moe_rank, (2, free_port(), *layout, str(out))) for layout, out in outs.items()], 2)
    return {layout: {r: torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)} for layout, out in outs.items()}


@pytest.fixture(scope="module", params=LAYOUTS)
def run(request, layouts):
    return layouts[request.param], tiny_moe(request.param[0]).eval()


def _output_ranks(ranks: dict[int, dict]) -> list[dict]:
    """The ranks holding log-probs (the last pipeline stage's)."""
    return [r for r in ranks.values() if r["logp_live"] is not None]


def _hf_logprobs(hf, ids: torch.Tensor, forced: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad(), hf_routes(hf, forced=forced):
        return token_logprobs(hf(input_ids=ids).logits[:, :-1], ids[:, 1:])


def test_logprobs_match_hf_live_and_replayed(run):
    ranks, hf = run
    for r in _output_ranks(ranks):
        ids, mask = r["input_ids"], r["loss_mask"].bool()
        live = (r["logp_live"] - _hf_logprobs(hf, ids)).abs()
        assert live[mask].max() < 1e-5, live.max()
        replayed = (r["logp_replay"] - _hf_logprobs(hf, ids, forced=r["forced"])).abs()
        assert replayed[mask].max() < 1e-5, replayed.max()
        assert (r["logp_replay"] - r["logp_live"]).abs()[mask].max() > 1e-3  # the forced routes changed them


def test_the_replayed_experts_are_the_forced_ones_for_every_token(run):
    ranks, _ = run
    for r in ranks.values():
        rows, cols = r["input_ids"].shape
        forced = r["forced"].reshape(rows, cols, *r["forced"].shape[1:])
        ran = r["ran"].reshape(cols, rows, *r["ran"].shape[1:]).transpose(0, 1)  # megatron's [T, B] order
        stage = slice(r["first_layer"], r["first_layer"] + ran.shape[2])  # a pipeline stage's MoE layers
        assert torch.equal(ran, forced[:, :, stage])
        assert r["metrics"].unrouted_tokens == 0 and r["metrics"].router_agreement < 1.0


def _hf_grads(hf, ids: torch.Tensor, mask: torch.Tensor, forced: torch.Tensor | None) -> dict[str, torch.Tensor]:
    hf.zero_grad()
    with hf_routes(hf, forced=forced):
        logp = token_logprobs(hf(input_ids=ids).logits[:, :-1], ids[:, 1:])
    (logp * mask).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in hf.named_parameters()}
    hf.zero_grad()
    return grads


@pytest.mark.parametrize("replayed", [False, True])
def test_gradients_equal_hfs(run, replayed):
    """Every parameter's gradient (router and experts included), reduced and gathered under HF names,
    is HF's: with the live router and with replayed routes (the router's gradient then comes through
    the replayed experts' gathered probabilities)."""
    ranks, hf = run
    r = ranks[0]
    got = r["grads_replay" if replayed else "grads_live"]
    ref = _hf_grads(hf, r["input_ids"], r["grad_mask"], r["forced"] if replayed else None)
    assert list(got) == list(ref)
    for name, g in ref.items():
        assert g.abs().max() > 0, name
        assert torch.allclose(got[name], g, atol=1e-5, rtol=1e-4), f"{name}: {(got[name] - g).abs().max():.2e}"


def test_gathered_weights_are_the_hf_weights(run):
    ranks, hf = run
    got = ranks[0]["hf_before"]
    ref = dict(hf.named_parameters())
    assert list(got) == list(ref)
    for name, t in ref.items():
        assert torch.equal(got[name], t.detach()), name


def test_a_training_step_changes_every_weight_and_exports_what_it_trained(run):
    ranks, hf = run
    before, after = ranks[0]["hf_before"], ranks[0]["hf_after"]
    assert ranks[0]["grad_norm"] > 0
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert len(changed) == len(before), f"unchanged after the step: {sorted(set(before) - set(changed))[:4]}"
    hf.load_state_dict(after)
    for r in _output_ranks(ranks):
        mask = r["loss_mask"].bool()
        assert (r["logp_after"] - _hf_logprobs(hf, r["input_ids"])).abs()[mask].max() < 1e-5
