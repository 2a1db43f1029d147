"""Megatron-core with tensor and pipeline parallelism on CPU: two gloo ranks (spawned processes),
megatron's own schedules, DDP and fp32 optimizer under the learner.megatron.cpu patches.

For each layout (TP=2, PP=2) and model (tiny-qwen2; SmolLM2-135M, Llama family, PP=2 only: its 9
query / 3 KV heads do not split over 2 TP ranks): the log-probs of a fixed batch match the HF
model's (fp32, mean abs < 1e-4), the full weights gathered under HF names equal the HF model's
(conversion round trip), one optimizer step changes them, and the HF model loaded with the gathered
weights after the step gives the log-probs the Megatron model gives.

Starts torch.distributed (two gloo ranks on loopback).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from async_rl.cluster.net import free_port  # noqa: E402
from async_rl.learner.rl.algorithms import token_logprobs  # noqa: E402
from tests.unit._megatron_ranks import hf_model, run_rank  # noqa: E402
from tests.unit._spawn_jobs import spawn_jobs  # noqa: E402

LAYOUTS = [
    pytest.param(("tiny-qwen2", 2, 1), id="tiny-qwen2-tp2"),
    pytest.param(("tiny-qwen2", 1, 2), id="tiny-qwen2-pp2"),
    pytest.param(("smollm2", 1, 2), id="smollm2-pp2"),  # the preset's folder, from the session fixture
]


@pytest.fixture(scope="module")
def layouts(smollm2, tmp_path_factory) -> dict[tuple, dict[int, dict]]:
    """Every layout's ranks, from one spawn of two ranks (each layout a job of its own group)."""
    outs = {p.values[0]: tmp_path_factory.mktemp("megatron") for p in LAYOUTS}
    world = 2  # every layout's tp * pp
    jobs = []
    for (kind, tp, pp), out in outs.items():
        assert tp * pp == world
        # smollm2: the preset's folder, fetched into the model cache when absent (as the integration tier does)
        model = str(smollm2) if kind == "smollm2" else kind
        jobs.append((run_rank, (world, free_port(), model, tp, pp, str(out))))
    spawn_jobs(jobs, world)
    return {layout: {r: torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)} for layout, out in outs.items()}


@pytest.fixture(scope="module", params=LAYOUTS)
def run(request, layouts, smollm2):
    kind = str(smollm2) if request.param[0] == "smollm2" else request.param[0]
    return kind, layouts[request.param], hf_model(kind)


def _hf_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:])


def test_logprobs_match_the_hf_model(run):
    kind, ranks, hf = run
    last = ranks[len(ranks) - 1]  # last pipeline stage (and a TP rank): holds the log-probs
    ref = _hf_logprobs(hf, last["input_ids"])
    mask = last["loss_mask"].bool()
    diff = (last["logp_before"] - ref).abs()
    assert diff[mask].mean() < 1e-4, f"{kind}: mean |megatron - hf| = {diff[mask].mean():.2e}"
    assert diff.max() < 1e-3, diff.max()


def test_gathered_weights_are_the_hf_weights(run):
    kind, ranks, hf = run
    got = ranks[0]["hf_before"]
    ref = dict(hf.named_parameters())
    assert list(got) == list(ref)
    for name, t in ref.items():
        assert torch.equal(got[name], t.detach()), f"{kind}: {name} changed in the HF -> Megatron -> HF round trip"


def test_a_training_step_changes_the_weights_it_exports(run):
    kind, ranks, hf = run
    before, after = ranks[0]["hf_before"], ranks[0]["hf_after"]
    assert ranks[0]["grad_norm"] > 0
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert len(changed) == len(before), f"unchanged after the step: {sorted(set(before) - set(changed))[:4]}"
    hf.load_state_dict(after, strict=False)  # a tied lm_head follows the embedding
    last = ranks[len(ranks) - 1]
    ref = _hf_logprobs(hf, last["input_ids"])
    mask = last["loss_mask"].bool()
    assert (last["logp_after"] - ref).abs()[mask].mean() < 1e-4
    assert (last["logp_after"] - last["logp_before"]).abs()[mask].mean() > 1e-4  # the step moved the policy
