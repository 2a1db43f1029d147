"""MegatronBackend (the ModelBackend interface over megatron-core) with two gloo ranks on CPU, as
TP=2 and as PP=2, on tiny-qwen2: per-token log-probs and entropies of packed and padded
micro-batches equal the HF model's, the gradient of a loss summed over two micro-batches has the
HF model's norm (the interface's sum semantics), HF-named weights round-trip and change after a
step, and save/load restores them. Packed micro-batches given as THD (the Transformer Engine
branch, with a CPU stand-in for TE's attention) score as the block-diagonal mask does.

Starts torch.distributed (two gloo ranks on loopback).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from async_rl.cluster.net import free_port  # noqa: E402
from async_rl.learner.rl.algorithms import token_logprobs  # noqa: E402
from async_rl.models.tiny import resolve_model_path  # noqa: E402
from tests.unit._megatron_ranks import run_backend_rank  # noqa: E402
from tests.unit._spawn_jobs import spawn_jobs  # noqa: E402

LAYOUTS = [(2, 1), (1, 2)]  # (tp, pp)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> tuple[str, dict[tuple[int, int], list[dict]]]:
    """Both layouts' two ranks, from one spawn (each layout a job with a group of its own)."""
    model_dir = str(resolve_model_path("tiny-qwen2", str(tmp_path_factory.mktemp("models"))))
    outs = {layout: tmp_path_factory.mktemp("backend") for layout in LAYOUTS}
    spawn_jobs([(run_backend_rank, (2, free_port(), model_dir, *layout, str(out))) for layout, out in outs.items()], 2)
    return model_dir, {layout: [torch.load(out / f"backend{r}.pt", weights_only=False) for r in range(2)]
                       for layout, out in outs.items()}


@pytest.fixture(scope="module", params=LAYOUTS, ids=["tp2", "pp2"])
def run(request, layouts):
    from transformers import AutoModelForCausalLM

    model_dir, ranks = layouts
    tp, pp = request.param
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tp, pp, ranks[request.param], hf


def _hf_scores(hf, mb):
    with torch.no_grad():
        logits = hf(**mb.model_inputs(torch.device("cpu"))).logits
    logp = token_logprobs(logits, mb.targets)
    p = torch.log_softmax(logits.float(), dim=-1)
    return logp, -(p.exp() * p).sum(-1)


def test_parallel_info_names_fetcher_and_output_ranks(run):
    tp, pp, ranks, _ = run
    infos = [r["info"] for r in ranks]
    assert [i.dp_size for i in infos] == [1, 1]
    assert [i.fetches_batch for i in infos] == ([True, False])
    assert [i.has_outputs for i in infos] == ([True, True] if pp == 1 else [False, True])


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_scores_match_the_hf_model(run, layout):
    tp, pp, ranks, hf = run
    last = ranks[1]
    mb = last["mbs"][layout]
    logp, entropy = _hf_scores(hf, mb)
    got = last["scores"][layout]
    mask = mb.loss_mask.bool()
    assert (got.logp - logp).abs()[mask].mean() < 1e-4, (got.logp - logp).abs()[mask].max()
    first = ranks[0]["scores"][layout]  # the first stage gets the last stage's scores (probe on rank 0)
    assert torch.equal(first.logp, got.logp)
    # no caller reads a scoring pass's entropy: it is not computed (training computes it, below)
    assert got.entropy is None and first.entropy is None


def test_packed_as_thd_equals_the_masked_packed_path_on_every_rank(run):
    """The Transformer Engine branch's inputs (rows flattened, cu_seqlens, no mask) through megatron's
    THD path, with a CPU stand-in for TE's attention: per-token log-probs, entropies and last hidden
    states equal the block-diagonal-mask path's (which equals the HF model's above), on both TP ranks
    and on both pipeline stages."""
    tp, pp, ranks, hf = run
    for r in ranks:
        thd, masked = r["thd_scores"], r["scores"]["packed"]
        assert thd.logp.shape == masked.logp.shape == r["mbs"]["packed"].input_ids.shape
        assert (thd.logp - masked.logp).abs().max() < 1e-5, (thd.logp - masked.logp).abs().max()
        assert (thd.hidden - r["packed_hidden"]).abs().max() < 1e-5


def test_last_hidden_states_match_the_hf_model_on_every_rank(run):
    """ppo's critic input: the final layernorm's output, HF's hidden_states[-1], on both TP ranks and
    on both pipeline stages (the first gets the last stage's)."""
    tp, pp, ranks, hf = run
    mb = ranks[1]["mbs"]["padded"]
    with torch.no_grad():
        want = hf(**mb.model_inputs(torch.device("cpu")), output_hidden_states=True).hidden_states[-1]
    mask = mb.attention_mask.bool()
    for r in ranks:
        assert r["hidden"].shape == want.shape
        assert (r["hidden"] - want).abs()[mask].max() < 1e-4, (r["hidden"] - want).abs()[mask].max()


def test_hidden_states_without_the_head_are_the_same_and_carry_no_log_probs(run):
    """`score(head=False)` (ppo's critic without a probe): the output layer is skipped."""
    tp, pp, ranks, hf = run
    for r in ranks:
        assert r["headless"].logp is None and r["headless"].entropy is None
        assert torch.equal(r["headless"].hidden, r["hidden"])


def test_critic_step_on_every_rank_is_the_single_process_step(run):
    """ppo's critic all-reduces its gradients over the whole learner group, TP and PP peers included:
    they read the same hidden states from the backend, so the mean is the data-parallel one and
    every rank's head equals one update on the HF model's hidden states."""
    from tests.unit._megatron_ranks import critic_step

    tp, pp, ranks, hf = run
    mb = ranks[1]["mbs"]["padded"]
    with torch.no_grad():
        want_hidden = hf(**mb.model_inputs(torch.device("cpu")), output_hidden_states=True).hidden_states[-1]
    want = critic_step(want_hidden, mb.attention_mask.float())  # no process group here: no all-reduce
    for r in ranks:
        for name, t in want.items():
            assert torch.allclose(r["critic_head"][name], t, rtol=0, atol=1e-5), name


def test_gradient_is_the_sum_over_micro_batches(run):
    """One loss -sum(logp)/tokens over two micro-batches: the gradient norm is the HF model's on the
    whole batch (megatron's 1/num_microbatches undone)."""
    tp, pp, ranks, hf = run
    halves = ranks[0]["halves"]
    tokens = sum(mb.loss_tokens for mb in halves)
    hf.zero_grad()
    for mb in halves:
        logits = hf(**mb.model_inputs(torch.device("cpu"))).logits
        (-(token_logprobs(logits, mb.targets) * mb.loss_mask).sum() / tokens).backward()
    ref = torch.nn.utils.clip_grad_norm_(hf.parameters(), 1e9)
    for r in ranks:
        assert abs(r["grad_norm"] - float(ref)) < 1e-4 * float(ref), (r["grad_norm"], float(ref))


def test_chunked_head_equals_the_full_vocab_parallel_head(run):
    """The output layer at the scored positions only, 3 positions a chunk (`megatron.head`: one
    softmax for both, logits recomputed in backward), against GPTModel's own vocab-parallel head at
    every position: scored log-probs, the training pass's log-probs and entropies at the loss
    positions, and every rank's gradients."""
    tp, pp, ranks, hf = run
    for r in ranks:
        (full, full_grads, full_trained, _), (chunked, chunked_grads, chunked_trained, _) = r["head_cmp"][0], r["head_cmp"][3]
        mask = r["mbs"]["padded"].loss_mask.bool()
        assert (chunked.logp - full.logp).abs()[mask].max() < 1e-5
        assert torch.all(chunked.logp[~r["mbs"]["padded"].span_positions()] == 0)
        assert len(full_trained) == len(chunked_trained) == (len(r["halves"]) if r["info"].has_outputs else 0)
        halves = r["halves"] if r["info"].has_outputs else []
        for (lp_full, ent_full), (lp, ent), mb in zip(full_trained, chunked_trained, halves, strict=True):
            m = mb.loss_mask.bool()
            assert (lp - lp_full).abs()[m].max() < 1e-5
            assert (ent - ent_full).abs()[m].max() < 1e-5
        assert len(full_grads) == len(chunked_grads)
        for a, b in zip(full_grads, chunked_grads, strict=True):
            assert (a - b).abs().max() < 1e-5
        assert any(g.abs().sum() > 0 for g in chunked_grads)


def test_kept_logits_give_the_recomputing_heads_scores_and_gradients_exactly(run):
    """learner.logprob_keep_logits on megatron's chunked head: the backward reads each chunk's logits from
    the forward instead of recomputing them (the same product of the same operands), so every rank's
    scores, training log-probs, entropies and gradients are bitwise those of recomputing, and an output
    rank runs one matmul fewer per chunk (the two micro-batches' loss positions, 3 a chunk)."""
    tp, pp, ranks, hf = run
    for r in ranks:
        (scored, grads, trained, matmuls), (kept_scored, kept_grads, kept_trained, kept_matmuls) = (
            r["head_cmp"][3], r["head_cmp"]["kept"])
        chunks = sum(-(-mb.loss_tokens // 3) for mb in r["halves"]) if r["info"].has_outputs else 0
        assert matmuls - kept_matmuls == chunks
        assert torch.equal(kept_scored.logp, scored.logp)
        assert len(kept_trained) == len(trained)
        for a, b in zip(trained, kept_trained, strict=True):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert len(kept_grads) == len(grads) and all(torch.equal(a, b) for a, b in zip(grads, kept_grads, strict=True))


def test_training_entropy_is_the_hf_models(run):
    """The entropy the training pass logs (temperature 0.7), with both heads, equals the HF model's
    full-softmax entropy at the loss positions."""
    tp, pp, ranks, hf = run
    last = ranks[1]
    for chunk in (0, 3):
        for (_, ent), mb in zip(last["head_cmp"][chunk][2], last["halves"], strict=True):
            with torch.no_grad():
                logits = hf(**mb.model_inputs(torch.device("cpu"))).logits.float() / 0.7
            p = torch.log_softmax(logits, dim=-1)
            want = -(p.exp() * p).sum(-1)
            m = mb.loss_mask.bool()
            assert (ent - want).abs()[m].max() < 1e-4, (chunk, (ent - want).abs()[m].max())


def test_entropy_gradient_is_the_hf_models(run):
    """The loss -sum(entropy)/tokens (an entropy bonus alone) over two micro-batches: the gradient
    norm through the vocab-parallel entropy (reduced over TP ranks forward, identity backward), with
    the full and the chunked head, is the HF model's full-softmax entropy gradient's (both at the
    weights after the module's training step)."""
    tp, pp, ranks, hf = run
    hf = copy.deepcopy(hf)
    unexpected = hf.load_state_dict(ranks[0]["after"], strict=False).unexpected_keys  # the weights after the step
    assert not unexpected
    halves = ranks[0]["halves"]
    tokens = sum(mb.loss_tokens for mb in halves)
    for mb in halves:
        logits = hf(**mb.model_inputs(torch.device("cpu"))).logits.float()
        p = torch.log_softmax(logits, dim=-1)
        (((p.exp() * p).sum(-1) * mb.loss_mask).sum() / tokens).backward()
    ref = float(torch.nn.utils.clip_grad_norm_(hf.parameters(), 1e9))
    assert ref > 0
    for r in ranks:
        for chunk, norm in r["entropy_grad_norm"].items():
            assert abs(norm - ref) < 1e-4 * ref, (chunk, norm, ref)


def test_weights_round_trip_change_after_a_step_and_reload(run):
    tp, pp, ranks, hf = run
    before, after, reloaded = ranks[0]["before"], ranks[0]["after"], ranks[0]["reloaded"]
    ref = dict(hf.named_parameters())
    assert list(before) == list(ref)
    assert all(torch.equal(before[n], t.detach()) for n, t in ref.items())
    assert all(not torch.equal(before[n], after[n]) for n in before)
    assert all(torch.equal(after[n], reloaded[n]) for n in after)
    assert ranks[1]["before"] is None  # only rank 0 holds the gathered weights



def test_a_nan_gradient_on_one_rank_skips_the_step_on_every_rank(run):
    """megatron's own step would apply a NaN gradient in fp32/bf16 (it checks only under fp16's loss
    scaler): the backend finds it in rank 1's gradient buffer, and both ranks skip the step with
    their parameters and optimizer state bitwise unchanged."""
    tp, pp, ranks, hf = run
    for r in ranks:
        step = r["nan_step"]
        assert not math.isfinite(step["norm"])
        assert step["before"].keys() == step["after"].keys()
        assert any(k.startswith("opt") for k in step["before"])  # Adam's moments exist (a step was taken)
        for name, t in step["before"].items():
            assert torch.equal(step["after"][name], t), name
    hf_after = ranks[0]["nan_step"]["hf_after"]
    assert all(torch.equal(hf_after[n], t) for n, t in ranks[0]["after"].items())
