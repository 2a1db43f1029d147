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


def _scored(keep: bool, shard: VocabShard, temperature: float, entropy_in_loss: bool, dtype: torch.dtype,
            fused: bool = False):
    """(logp, entropy, hidden.grad, weight.grad, tensors saved for backward) of 29 positions in chunks of 8
    through one shard of a 97-row weight (an offset shard's targets fall inside and outside it)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(29, 16, generator=g).to(dtype).requires_grad_()
    w = (0.3 * torch.randn(97, 16, generator=g)).to(dtype).requires_grad_()
    targets = torch.randint(0, 97 if shard.whole else 300, (29,), generator=g)  # a whole shard holds every target
    logp, entropy = chunked_scores(h, w, targets, temperature, 8, shard, True, fused, keep)
    saved = len(logp.grad_fn.saved_tensors)
    loss = (logp * torch.randn(29, generator=g)).sum()
    if entropy_in_loss:
        loss = loss + (entropy * torch.randn(29, generator=g)).sum()
    loss.backward()
    return logp, entropy, h.grad, w.grad, saved


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shard", [VocabShard.of(97, 97, 0, None), VocabShard(start=150, valid=90)],
                         ids=["whole", "offset"])
@pytest.mark.parametrize("temperature,entropy_in_loss", [(1.0, False), (0.7, True)])
def test_kept_logits_give_the_recomputing_heads_values_and_gradients_exactly(
        monkeypatch, fused, dtype, shard, temperature, entropy_in_loss):
    """learner.logprob_keep_logits: the backward reads each chunk's logits from the forward (the same
    product of the same operands as its recomputation), so every output and gradient is bitwise the same,
    eager and fused (head_fused's functions as written), on a whole and an offset shard; the forward
    saves one tensor a chunk more (4 chunks)."""
    from async_rl.learner.model import head_fused

    monkeypatch.setattr(head_fused, "compiled", lambda: head_fused.EAGER)
    recomputed = _scored(False, shard, temperature, entropy_in_loss, dtype, fused)
    kept = _scored(True, shard, temperature, entropy_in_loss, dtype, fused)
    for a, b in zip(recomputed[:4], kept[:4], strict=True):
        assert torch.equal(a, b)
    assert kept[4] == recomputed[4] + 4


def test_kept_logits_save_one_matmul_a_chunk_and_nothing_in_a_no_grad_pass():
    """Three chunks: 3 forward matmuls, then 3 (recomputed logits, the two gradients) a chunk in the
    backward, 2 with kept logits; asked for in a no-grad scoring pass, nothing is kept."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Matmuls(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
                Matmuls.count += 1
            return func(*args, **(kwargs or {}))

    h, w, g = inputs()
    targets = torch.randint(0, V, (3 * 100,), generator=g)
    shard = VocabShard.of(V, V, 0, None)
    counts = {}
    for keep in (False, True):
        Matmuls.count = 0
        with Matmuls():
            logp, _ = chunked_scores(h[:300], w, targets, 1.0, 100, shard, True, False, keep)
            logp.sum().backward()
        counts[keep] = Matmuls.count
    assert counts == {False: 12, True: 9}
    with torch.no_grad():
        logp, _ = chunked_scores(h[:300], w, targets, 1.0, 100, shard, True, False, True)
    assert logp.grad_fn is None  # nothing saved, nothing kept


def test_kept_fp32_logits_survive_a_second_backward():
    """retain_graph at temperature 1 in fp32, where the scaled copy of a chunk's logits would be the kept
    tensor itself: the eager backward works in a copy, so a second backward gives the same gradient."""
    h, w, g = inputs()
    targets = torch.randint(0, V, (N,), generator=g)
    logp, entropy = chunked_scores(h, w, targets, 1.0, CHUNK, VocabShard.of(V, V, 0, None), True, False, True)
    (logp.sum() + entropy.sum()).backward(retain_graph=True)
    first = h.grad.clone()
    h.grad = None
    (logp.sum() + entropy.sum()).backward()
    assert torch.equal(h.grad, first)
