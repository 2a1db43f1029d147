"""The chunked head's compiled arithmetic (learner/model/head_fused.py, `learner.head_kernel`): the same
log-probs, entropies and gradients as the eager loop of `ChunkedHead`, for every combination of
outputs the losses use, at temperature 1 and not, and compiled by inductor on the CPU."""

from __future__ import annotations

import pytest
import torch

from async_rl.learner.model import head_fused
from async_rl.learner.model.head import flat_index, head_scores


def run_head(fused: bool, temperature: float, entropy_grad: bool, logp_grad: bool, with_entropy: bool = True,
             dtype: torch.dtype = torch.float32, seed: int = 0, keep_logits: bool = False):
    """(logp, entropy, hidden.grad, weight.grad) of the chunked head over a holed batch, 3 chunks."""
    torch.manual_seed(seed)
    b, t, h, v = 3, 11, 16, 97
    hidden = torch.randn(b, t, h).to(dtype).requires_grad_()
    weight = (0.3 * torch.randn(v, h)).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (b, t))
    positions = torch.rand(b, t) > 0.3
    logp, entropy = head_scores(hidden, weight, targets, flat_index(positions), temperature, 9, with_entropy, fused,
                                keep_logits)
    loss = torch.zeros(())
    if logp_grad:
        loss = loss + (logp * torch.randn(b, t)).sum()
    if entropy_grad:
        loss = loss + (entropy * torch.randn(b, t)).sum()
    if logp_grad or entropy_grad:
        loss.backward()
    return logp, entropy, hidden.grad, weight.grad


@pytest.fixture
def eager_functions(monkeypatch):
    """The fused path with head_fused's functions run as written (no compile): every branch is cheap."""
    monkeypatch.setattr(head_fused, "compiled", lambda: head_fused.EAGER)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad,logp_grad", [(False, True), (True, False), (True, True)])
def test_fused_arithmetic_equals_the_eager_head(eager_functions, temperature, entropy_grad, logp_grad):
    eager = run_head(False, temperature, entropy_grad, logp_grad)
    fused = run_head(True, temperature, entropy_grad, logp_grad)
    for a, b in zip(eager[:2], fused[:2], strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    for a, b in zip(eager[2:], fused[2:], strict=True):  # gradients, relative
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-4)


def test_fused_scoring_pass_without_entropy(eager_functions):
    eager = run_head(False, 0.7, False, False, with_entropy=False)
    fused = run_head(True, 0.7, False, False, with_entropy=False)
    assert eager[1] is None and fused[1] is None
    torch.testing.assert_close(fused[0], eager[0], atol=1e-5, rtol=0)


def test_fused_bf16_gradients_are_in_bf16_within_rounding_of_the_eager_head(eager_functions):
    eager = run_head(False, 1.0, True, True, dtype=torch.bfloat16)
    fused = run_head(True, 1.0, True, True, dtype=torch.bfloat16)
    assert fused[2].dtype == fused[3].dtype == torch.bfloat16
    torch.testing.assert_close(fused[0], eager[0], atol=1e-5, rtol=0)  # the same bf16 logits, fp32 arithmetic
    torch.testing.assert_close(fused[2].float(), eager[2].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fused[3].float(), eager[3].float(), atol=2e-2, rtol=2e-2)


def test_inductor_compiled_head_equals_the_eager_head():
    """The real compile (inductor's CPU code; on CUDA it generates Triton): a training step's pass,
    log-prob and entropy gradients at temperature 0.7, then a second batch with another chunk count and
    vocabulary-sized shapes reuses the compiled code."""
    eager = run_head(False, 0.7, True, True)
    fused = run_head(True, 0.7, True, True)
    for a, b in zip(eager, fused, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    again = run_head(True, 0.7, True, True, seed=1)
    torch.testing.assert_close(again[0], run_head(False, 0.7, True, True, seed=1)[0], atol=1e-5, rtol=0)


def test_the_compiled_head_compiles_once_for_every_chunk_count():
    """A micro-batch that fits one chunk, then micro-batches of two and four chunks with a shorter last
    one: the compiled functions do not compile again (on an H200 they did: duck sizing tied a sliced
    argument's base length to the single chunk's, head_fused._one_compile)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    head_fused.compiled.cache_clear()
    weight = (0.3 * torch.randn(97, 16)).requires_grad_()

    def step(rows: int) -> None:
        hidden = torch.randn(rows, 40, 16, requires_grad=True)
        targets = torch.randint(0, 97, (rows, 40))
        index = flat_index(torch.rand(rows, 40) > 0.2)
        logp, entropy = head_scores(hidden, weight, targets, index, 0.7, 64, True, True)
        (logp.sum() + entropy.sum()).backward()

    before = counters["stats"]["unique_graphs"]  # counts over the process, other tests' compiles too
    step(1)  # at most 40 positions: one chunk of the 64
    graphs = counters["stats"]["unique_graphs"]
    assert graphs - before == 2  # the forward's statistics and the backward's gradient
    for rows in (3, 6):  # ~96 and ~192 positions
        step(rows)
    assert counters["stats"]["unique_graphs"] == graphs


def run_shard(fused: bool, shard, temperature: float, entropy_grad: bool, with_entropy: bool = True):
    """Megatron's vocab-parallel head on one shard of a 97-row weight (the first `shard.valid` rows
    are its vocabulary ids shard.start...; targets fall inside and outside it), no process group: the
    shard's own partial results, which TP ranks would sum."""
    from async_rl.learner.megatron.head import chunked_scores

    torch.manual_seed(0)
    hidden = torch.randn(29, 16, requires_grad=True)
    weight = (0.3 * torch.randn(97, 16)).requires_grad_()
    targets = torch.randint(0, 300, (29,))
    logp, entropy = chunked_scores(hidden, weight, targets, temperature, 8, shard, with_entropy, fused)
    loss = (logp * torch.randn(29)).sum() + ((entropy * torch.randn(29)).sum() if entropy_grad else 0)
    loss.backward()
    return logp, entropy, hidden.grad, weight.grad


SHARDS = {"whole": (0, 90), "offset": (150, 97)}  # (first id, real rows): the first with 7 padding rows


@pytest.mark.parametrize("shard", list(SHARDS))
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_fused_megatron_shard_arithmetic_equals_the_eager_head(eager_functions, shard, entropy_grad):
    from async_rl.learner.megatron.head import VocabShard

    vs = VocabShard(*SHARDS[shard])
    eager, fused = run_shard(False, vs, 0.7, entropy_grad), run_shard(True, vs, 0.7, entropy_grad)
    for a, b in zip(eager, fused, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    assert torch.all(fused[3][vs.valid :] == 0)  # padding rows: no gradient
    no_entropy = run_shard(True, vs, 0.7, False, with_entropy=False)
    torch.testing.assert_close(no_entropy[0], eager[0], atol=1e-5, rtol=0)


def test_inductor_compiled_megatron_shard_head_equals_the_eager_head():
    from async_rl.learner.megatron.head import VocabShard

    vs = VocabShard(*SHARDS["offset"])
    eager, fused = run_shard(False, vs, 0.7, True), run_shard(True, vs, 0.7, True)
    for a, b in zip(eager, fused, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def test_the_kl_reference_pass_runs_the_compiled_head_where_the_policy_does(model_dir, monkeypatch):
    """ReferencePolicy follows learner.head_kernel: compiled -> the fused per-chunk arithmetic (here
    head_fused's functions run as written, counted), the same log-probs as the eager head."""
    from async_rl.learner.batch.cut import ONE_MICRO_BATCH
    from async_rl.learner.batch.padded import PaddedShard
    from async_rl.learner.rl.reference import ReferencePolicy
    from tests.unit._learner_fixtures import groups

    calls = []
    monkeypatch.setattr(head_fused, "compiled", lambda: calls.append(1) or head_fused.EAGER)
    shard = PaddedShard(groups(3))
    eager, fused, auto = (ReferencePolicy(str(model_dir), torch.float32, cut=ONE_MICRO_BATCH, head_kernel=k)
                          for k in ("eager", "compiled", "auto"))
    assert (eager.fused, fused.fused, auto.fused) == (False, True, False)  # auto: eager on the CPU
    want = eager.score(shard, 0.7)
    assert not calls
    got = fused.score(shard, 0.7)
    assert calls and want.abs().sum() > 0
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("entropy_grad,logp_grad", [(False, True), (True, False), (True, True)])
@pytest.mark.parametrize("start", [0, 40])
def test_the_eager_in_place_gradient_equals_chunk_grad_on_a_vocabulary_shard(entropy_grad, logp_grad, start):
    """`eager_chunk_grad_` (both heads' eager backward) is `chunk_grad`'s arithmetic, in place: on a shard
    of rows [start, start + 30) of a 97-token vocabulary, targets off the shard get no one-hot."""
    torch.manual_seed(1)
    c, rows, t = 12, 30, 0.7
    z = torch.randn(c, rows)
    targets = torch.randint(0, 97, (c,))
    targets[:3] = torch.tensor([start, start + rows - 1, start + rows])  # the shard's first and last, one past it
    lse = torch.logsumexp(z / t, -1) + 0.5  # as if the other shards held part of the mass
    entropy = torch.rand(c) + 1.0
    g_logp = torch.randn(c) if logp_grad else None
    g_entropy = torch.randn(c) if entropy_grad else None
    local = targets - start
    want = head_fused.chunk_grad(z, lse, entropy, local, g_logp, g_entropy, t, torch.float32)
    got = head_fused.eager_chunk_grad_(z / t - lse[:, None], entropy, local, g_logp, g_entropy, t, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature,entropy_grad,logp_grad", [(1.0, False, True), (0.7, True, True)])
def test_kept_logits_give_the_recomputing_heads_values_and_gradients_exactly(
        eager_functions, fused, dtype, temperature, entropy_grad, logp_grad):
    """learner.logprob_keep_logits: the backward reads the forward's logits instead of recomputing them,
    the same product of the same operands, so every output and gradient is bitwise the same."""
    recomputed = run_head(fused, temperature, entropy_grad, logp_grad, dtype=dtype)
    kept = run_head(fused, temperature, entropy_grad, logp_grad, dtype=dtype, keep_logits=True)
    for a, b in zip(recomputed, kept, strict=True):
        assert torch.equal(a, b)


def test_kept_logits_save_one_matmul_a_chunk_and_are_held_only_with_a_gradient_to_come():
    """Three chunks: the backward runs 3 matmuls fewer. In the forward, when the last chunk's matmul
    runs, the two earlier chunks' logits are still held where a gradient is to come, and at most the
    one before it otherwise (recomputing, or kept_logits asked for in a no-grad scoring pass)."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    class Matmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count, self.products, self.alive_at_last = 0, [], []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
                self.count += 1
                self.alive_at_last.append(sum(r() is not None for r in self.products))
                self.products.append(weakref.ref(out))
            return out

    torch.manual_seed(0)
    hidden, weight = torch.randn(3, 9, 16, requires_grad=True), torch.randn(97, 16, requires_grad=True)
    targets, index = torch.randint(0, 97, (3, 9)), torch.arange(25)
    seen = {}
    for keep, grad in ((False, True), (True, True), (True, False)):
        with torch.set_grad_enabled(grad), Matmuls() as mode:
            logp, _ = head_scores(hidden, weight, targets, index, 1.0, 9, True, False, keep)
            forward = (mode.count, mode.alive_at_last[2])
            if grad:
                logp.sum().backward()
        seen[keep, grad] = (*forward, mode.count)
    # (forward matmuls, earlier chunks' logits alive at the third, matmuls in all)
    assert seen == {(False, True): (3, 1, 12), (True, True): (3, 2, 9), (True, False): (3, 1, 3)}


def test_a_learner_keeping_the_logits_takes_the_same_step(model_dir):
    """learner.logprob_keep_logits through the torch backend: the same loss and the same weights after a
    step as recomputing them; auto keeps nothing on the CPU."""
    from tests.unit._learner_fixtures import groups, make_rank

    steps = {}
    for keep in ("auto", True):
        rank = make_rank(model_dir, logprob_keep_logits=keep, logprob_chunk_tokens=7)  # several chunks
        m = rank.train_on_shard(0, groups(0))
        steps[keep] = (rank.backend.keeps_logits, m.loss, [p.detach().clone() for p in rank.backend.model.parameters()])
        rank.shutdown()
    assert (steps["auto"][0], steps[True][0]) == (False, True)
    assert steps["auto"][1] == steps[True][1]
    assert all(torch.equal(a, b) for a, b in zip(steps["auto"][2], steps[True][2], strict=True))


def test_kept_logits_survive_a_second_backward():
    """retain_graph: the eager backward computes its gradient in place, never in the kept logits (fp32 at
    temperature 1, where the scaled copy would be the kept tensor itself)."""
    from async_rl.learner.model.head import ChunkedHead

    torch.manual_seed(0)
    hidden, weight = torch.randn(20, 16, requires_grad=True), torch.randn(97, 16, requires_grad=True)
    logp, _ = ChunkedHead.apply(hidden, weight, torch.randint(0, 97, (20,)), 1.0, 9, True, False, True)
    logp.sum().backward(retain_graph=True)
    first = hidden.grad.clone()
    hidden.grad = None
    logp.sum().backward()
    assert torch.equal(hidden.grad, first)


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_a_megatron_rank_holding_the_whole_vocabulary_runs_the_one_pass_statistics(monkeypatch, entropy_grad):
    """One TP rank (`VocabShard.of` without a group: `whole`): the fused path runs the torch head's chunk
    statistics (one pass; "triton" then means Triton's kernel there), not the shard max and sums, with
    the eager head's values and gradients; a shard of several (no `whole`) keeps the shard kernels."""
    from async_rl.learner.megatron.head import VocabShard, chunked_scores

    calls = []

    def counted(name, f):
        return lambda *a: calls.append(name) or f(*a)

    eager = head_fused.EAGER
    monkeypatch.setattr(head_fused, "compiled", lambda: head_fused.HeadKernels(
        counted("stats", eager.stats), eager.grad, counted("shard_max", eager.shard_max), eager.shard_sums))
    whole = VocabShard.of(300, 97 + 203, 0, None)  # 300 real ids, targets among them
    assert whole.whole and not VocabShard(*SHARDS["whole"]).whole
    torch.manual_seed(0)
    weight = 0.3 * torch.randn(300, 16)
    out = {}
    for fused in (False, True):
        torch.manual_seed(1)
        hidden, w = torch.randn(29, 16, requires_grad=True), weight.clone().requires_grad_()
        logp, entropy = chunked_scores(hidden, w, torch.randint(0, 300, (29,)), 0.7, 8, whole, True, fused)
        loss = (logp * torch.randn(29)).sum() + ((entropy * torch.randn(29)).sum() if entropy_grad else 0)
        loss.backward()
        out[fused] = (logp, entropy, hidden.grad, w.grad)
    assert calls == ["stats"] * 4  # 29 positions in chunks of 8
    for a, b in zip(out[False], out[True], strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    calls.clear()
    run_shard(True, VocabShard(*SHARDS["whole"]), 0.7, entropy_grad)
    assert calls and set(calls) == {"shard_max"}
