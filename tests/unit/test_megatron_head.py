"""The Megatron backend's chunked vocab-parallel head (`learner.megatron.head`) on one TP rank, CPU,
fp32: log-probs, entropies and their gradients equal a full log-softmax's (temperature != 1, a padded
vocabulary), and the memory a chunk holds, measured: the peak of the CPU allocator's own allocation
events (torch.profiler with profile_memory) over one call, in units of one fp32 [chunk x vocab]
tensor. TP > 1 runs through the backend in test_megatron_backend.py (two gloo ranks)."""

from __future__ import annotations

import pytest
import torch

from async_rl.learner.megatron.head import VocabShard, chunked_scores

N, H, V, CHUNK = 512, 16, 4096, 256  # two chunks; V x H is small beside CHUNK x V (the gradient's buffer)
UNIT = CHUNK * V * 4  # bytes of one fp32 [chunk x vocab] tensor
EXTRA = 0.25  # what a chunk may hold besides: [N]/[chunk] vectors, hidden and weight-sized buffers (V*H/(CHUNK*V) = 6%)


def reference(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, vocab: int, temperature: float):
    logp_all = torch.log_softmax((h @ w[:vocab].t()) / temperature, dim=-1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, requires_grad=True)
    w = torch.randn(V, H, generator=g, requires_grad=True)
    return h, w, g


def peak_bytes(fn) -> int:
    """The highest net allocation (bytes) the CPU allocator reported while `fn` ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    assert any(n > 0 for _, n in events), "the profiler recorded no allocation"
    now = peak = 0
    for _, n in events:
        now += n
        peak = max(peak, now)
    return peak


@pytest.mark.parametrize("entropy_in_loss", [False, True])
def test_values_and_gradients_are_a_full_softmaxs(entropy_in_loss):
    vocab = V - 100  # the weight's last rows pad the vocabulary: never a target, never in the softmax
    h, w, g = inputs()
    targets = torch.randint(0, vocab, (N,), generator=g)
    shard = VocabShard.of(vocab, V, 0, None)
    logp, entropy = chunked_scores(h, w, targets, 0.7, 100, shard, with_entropy=True)
    want_logp, want_entropy = reference(h, w, targets, vocab, 0.7)
    assert (logp - want_logp).abs().max() < 1e-4
    assert (entropy - want_entropy).abs().max() < 1e-4
    a, b = torch.randn(N, generator=g), torch.randn(N, generator=g)
    got = torch.autograd.grad((logp * a).sum() + ((entropy * b).sum() if entropy_in_loss else 0), (h, w))
    want = torch.autograd.grad((want_logp * a).sum() + ((want_entropy * b).sum() if entropy_in_loss else 0), (h, w))
    for x, y in zip(got, want, strict=True):
        assert (x - y).abs().max() < 1e-4 * max(1.0, float(y.abs().max()))
    assert torch.all(got[1][vocab:] == 0)


def test_without_entropy_the_log_probs_are_the_same_and_the_entropy_zero():
    h, w, g = inputs()
    targets = torch.randint(0, V, (N,), generator=g)
    shard = VocabShard.of(V, V, 0, None)
    with_e, _ = chunked_scores(h, w, targets, 1.0, CHUNK, shard, with_entropy=True)
    without, entropy = chunked_scores(h, w, targets, 1.0, CHUNK, shard, with_entropy=False)
    assert torch.equal(with_e, without) and torch.all(entropy == 0) and not entropy.requires_grad


def test_a_shard_past_the_vocabulary_scores_nothing():
    """A TP rank whose rows are all padding (tiny vocabularies): no matmul rows, no target."""
    assert VocabShard.of(50, 16, 3, None) == VocabShard(start=48, valid=2)
    assert VocabShard.of(40, 16, 3, None).valid == 0


@pytest.mark.parametrize("with_entropy,units", [(True, 2), (False, 1)])
def test_forward_holds_at_most_two_chunk_sized_fp32_tensors(with_entropy, units):
    """The logits and, with the entropy, their exponentials; nothing chunk-sized survives a chunk
    (two chunks run: a tensor kept across them would show as more)."""
    h, w, g = inputs()
    targets = torch.randint(0, V, (N,), generator=g)
    shard = VocabShard.of(V, V, 0, None)
    peak = peak_bytes(lambda: chunked_scores(h, w, targets, 0.7, CHUNK, shard, with_entropy))
    assert peak <= (units + EXTRA) * UNIT, peak / UNIT
    assert peak >= units * UNIT  # the measurement sees the chunk's tensors


@pytest.mark.parametrize("entropy_in_loss,units", [(False, 1), (True, 2)])
def test_backward_recomputes_the_entropy_only_where_a_loss_uses_it(entropy_in_loss, units):
    """The entropy computed for the metric (forward, with_entropy) costs backward nothing: one fp32
    [chunk x vocab] tensor (the softmax) when the loss reads the log-probs only, two with an entropy
    term in the loss."""
    h, w, g = inputs()
    targets = torch.randint(0, V, (N,), generator=g)
    logp, entropy = chunked_scores(h, w, targets, 0.7, CHUNK, VocabShard.of(V, V, 0, None), with_entropy=True)
    loss = logp.sum() + (entropy.sum() if entropy_in_loss else 0)
    peak = peak_bytes(loss.backward)
    assert peak <= (units + EXTRA) * UNIT, peak / UNIT
    assert peak >= units * UNIT


def test_the_measurement_sees_a_head_that_keeps_more():
    """The same sizes through a plain log-softmax head with entropy: several fp32 [chunk x vocab]
    tensors live at once, and the measurement says so (the bounds above can fail)."""
    h, w, g = inputs()
    hc, targets = h[:CHUNK].detach(), torch.randint(0, V, (CHUNK,), generator=g)
    peak = peak_bytes(lambda: reference(hc, w.detach(), targets, V, 0.7))
    assert peak > (2 + EXTRA) * UNIT, peak / UNIT
