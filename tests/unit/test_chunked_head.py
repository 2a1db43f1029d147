"""The chunked head (learner/model/head.py): log-probs, entropies and gradients equal to the full head's,
no [positions x vocabulary] tensor larger than a chunk, the scoring passes micro-batched, and the KL
reference and ppo's critic on the backend's device."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from async_rl.config import AlgorithmConfig
from async_rl.learner import driver as driver_mod
from async_rl.learner.driver import LearnerDriver
from async_rl.learner.model.head import ChunkedHead, flat_index, full_token_scores, head_scores
from tests.unit._learner_fixtures import groups, make_rank, settings


def holed_groups(seed: int) -> list:
    """groups() with multi-turn style loss masks: holes (environment tokens) inside completions."""
    gs = groups(seed, n_groups=3, group_size=3)
    rng = np.random.default_rng(seed)
    for g in gs:
        g.loss_masks = [(rng.random(len(c)) > 0.3).astype(np.int8) for c in g.completions]
        for m in g.loss_masks:
            m[0] = 1
    return gs


# ---------------------------------------------------------------- the function itself


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_chunked_head_equals_full_head(temperature, chunk):
    torch.manual_seed(0)
    b, t, h, v = 3, 9, 16, 70
    hidden = torch.randn(b, t, h, requires_grad=True)
    weight = (0.3 * torch.randn(v, h)).requires_grad_()
    targets = torch.randint(0, v, (b, t))
    positions = torch.rand(b, t) > 0.4  # holes
    upstream = torch.randn(b, t)
    logp, entropy = head_scores(hidden, weight, targets, flat_index(positions), temperature, chunk)
    (logp * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    full_logp, full_entropy = full_token_scores(hidden @ weight.t(), targets, temperature)
    (full_logp * positions * upstream).sum().backward()
    assert torch.all(logp[~positions] == 0) and torch.all(entropy[~positions] == 0)
    torch.testing.assert_close(logp[positions], full_logp[positions], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy[positions], full_entropy[positions], atol=1e-5, rtol=0)
    torch.testing.assert_close(grads[0], hidden.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(grads[1], weight.grad, atol=1e-5, rtol=0)


def test_head_without_entropy_gives_the_same_log_probs_and_gradients():
    """entropy=False (the scoring passes): no entropy computed, log-probs and their gradients as with it."""
    torch.manual_seed(1)
    hidden = torch.randn(2, 7, 16, requires_grad=True)
    weight = (0.3 * torch.randn(50, 16)).requires_grad_()
    targets = torch.randint(0, 50, (2, 7))
    positions = torch.rand(2, 7) > 0.3
    out = {}
    for with_entropy in (True, False):
        logp, entropy = head_scores(hidden, weight, targets, flat_index(positions), 0.7, 3, entropy=with_entropy)
        assert (entropy is None) == (not with_entropy)
        logp.sum().backward()
        out[with_entropy] = logp.detach(), hidden.grad.clone(), weight.grad.clone()
        hidden.grad = weight.grad = None
    for a, b in zip(out[True], out[False], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- the torch backend, full vs chunked


def _backend_pass(rank: LearnerDriver, gs, temperature: float):
    """One forward+backward of the driver's micro-batches with a loss that weights every loss token
    differently; returns (logp and entropy at loss positions, gradients by name)."""
    from async_rl.learner.driver import shard_samples

    mbs = rank._micro_batches(shard_samples(gs))
    seen = []

    def loss_fn(i, scores):
        mask = mbs[i].loss_mask
        seen.append((scores.logp.detach()[mask != 0], scores.entropy[mask != 0]))
        w = torch.linspace(0.5, 1.5, mask.numel()).reshape(mask.shape)
        return (scores.logp * mask * w).sum()

    rank.backend.forward_backward(mbs, temperature, loss_fn)
    grads = {n: p.grad.clone() for n, p in rank.backend.model.named_parameters()}
    return torch.cat([s[0] for s in seen]), torch.cat([s[1] for s in seen]), grads


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_backend_chunked_head_equals_the_full_head(model_dir, temperature, chunk):
    """Values and gradients (fp32, max abs < 1e-5) on packed micro-batches with loss-mask holes; the
    tied output embedding (tiny-qwen2 ties it, like SmolLM2) gets the head's and the lookup's."""
    gs = holed_groups(3)
    full = make_rank(model_dir, logprob_chunk_tokens=0, micro_batch_tokens=40)
    chunked = make_rank(model_dir, logprob_chunk_tokens=chunk, micro_batch_tokens=40)
    model = chunked.backend.model
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    a = _backend_pass(full, gs, temperature)
    b = _backend_pass(chunked, gs, temperature)
    assert len(full._micro_batches(driver_mod.shard_samples(gs))) > 1
    torch.testing.assert_close(b[0], a[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(b[1], a[1], atol=1e-5, rtol=0)
    assert a[2].keys() == b[2].keys()
    for name in a[2]:
        torch.testing.assert_close(b[2][name], a[2][name], atol=1e-5, rtol=0, msg=name)
    assert b[2]["model.embed_tokens.weight"].abs().sum() > 0


def test_scoring_equals_the_full_head(model_dir):
    """compute_logprobs (completion positions, environment tokens included) agrees with the full head."""
    gs = holed_groups(4)
    full = make_rank(model_dir, logprob_chunk_tokens=0).compute_logprobs(gs, 0.8)
    chunked = make_rank(model_dir, logprob_chunk_tokens=3).compute_logprobs(gs, 0.8)
    assert [len(x) for x in chunked] == [len(c) for g in gs for c in g.completions]
    for a, b in zip(full, chunked, strict=True):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)


class _LargestVocabTensor(TorchDispatchMode):
    """Records the most rows of any tensor an op produces with the vocabulary as its last dimension,
    leaving out the output weight's own transpose ([hidden, vocab], `weight_numel` elements)."""

    def __init__(self, vocab: int, weight_numel: int) -> None:
        super().__init__()
        self.vocab, self.weight_numel, self.rows = vocab, weight_numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == self.vocab
                    and t.numel() != self.weight_numel):
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def test_no_vocabulary_tensor_larger_than_a_chunk(model_dir):
    """Forward and backward of a micro-batch never produce a [positions x vocab] tensor of more than
    `chunk` rows (the output weight's transpose, [hidden, vocab], is not one)."""
    gs = groups(5, n_groups=4, group_size=4)
    for chunk, bound in ((4, 4), (0, None)):
        rank = make_rank(model_dir, logprob_chunk_tokens=chunk)
        vocab = rank.backend.model.config.vocab_size
        assert rank.backend.model.config.hidden_size != vocab
        mbs = rank._micro_batches(driver_mod.shard_samples(gs))
        weight = rank.backend.model.get_output_embeddings().weight
        with _LargestVocabTensor(vocab, weight.numel()) as spy:
            rank.backend.forward_backward(mbs, 1.0, lambda i, s, mbs=mbs: (s.logp * mbs[i].loss_mask).sum())
        if bound is None:  # the full head: a row per position of the micro-batch
            assert spy.rows >= sum(mb.input_ids.numel() for mb in mbs)
        else:
            assert 0 < spy.rows <= bound


# ---------------------------------------------------------------- scoring passes


def test_scoring_passes_follow_micro_batch_tokens(model_dir, monkeypatch):
    """The decoupled proximal pass and ppo's hidden states run over the shard's micro-batches (each
    at most learner.micro_batch_tokens tokens) and equal one whole-shard pass; ppo's behaviour
    objective asks for no output layer; the KL reference scores micro-batches of at most that many tokens."""
    gs = groups(6, n_groups=3, group_size=4)
    algo = AlgorithmConfig(name="ppo", objective="decoupled", kl_coef=0.1)
    results = {}
    for budget in (0, 30):
        rank = make_rank(model_dir, micro_batch_tokens=budget, algorithm=algo)
        calls = []
        real_score = rank.backend.score

        def spy(mb, temperature, real_score=real_score, calls=calls, **kw):
            calls.append((int((mb.input_ids != 0).sum()), kw))  # real tokens (ids >= 3; padding is 0)
            return real_score(mb, temperature, **kw)

        monkeypatch.setattr(rank.backend, "score", spy)
        ref_shapes = []
        ref_model = rank.algo.reference.model.base_model  # the trunk (the head runs on its output)
        handle = ref_model.register_forward_pre_hook(
            lambda _m, args, kwargs, seen=ref_shapes: seen.append(int(kwargs["attention_mask"].sum())), with_kwargs=True
        )
        from async_rl.learner.batch.padded import PaddedShard

        shard = PaddedShard(gs)
        results[budget] = [
            rank._score_padded(gs, shard, True),
            rank.algo.reference.score(shard, 1.0),
        ]
        handle.remove()
        if budget:
            assert len(calls) > 1 and all(n <= budget for n, _ in calls)
            assert len(ref_shapes) > 1 and all(n <= budget for n in ref_shapes)  # real tokens, as the policy's
        else:
            assert len(calls) == 1 and len(ref_shapes) == 1
        assert all(kw == {"hidden": True, "head": True} for _, kw in calls)
    (lp0, h0), ref0 = results[0]
    (lp1, h1), ref1 = results[30]
    mask = PaddedShard(gs).loss_mask
    torch.testing.assert_close(lp1 * mask, lp0 * mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(h1 * mask[..., None], h0 * mask[..., None], atol=1e-5, rtol=0)
    torch.testing.assert_close(ref1, ref0, atol=1e-5, rtol=0)
    assert torch.all(ref0[mask == 0] == 0) and torch.all(ref0[mask != 0] < 0)


def test_ppo_behaviour_hidden_pass_skips_the_output_layer(model_dir, monkeypatch):
    rank = make_rank(model_dir, algorithm=AlgorithmConfig(name="ppo"))
    applied = []
    real = ChunkedHead.apply
    monkeypatch.setattr(ChunkedHead, "apply", lambda *a: applied.append(1) or real(*a))
    heads = []
    real_score = rank.backend.score
    monkeypatch.setattr(rank.backend, "score", lambda mb, t, **kw: heads.append(kw["head"]) or real_score(mb, t, **kw))
    from async_rl.learner.batch.padded import PaddedShard

    gs = groups(7)
    shard = PaddedShard(gs)
    prox, hidden = rank._score_padded(gs, shard, True, with_logp=False)
    assert prox is None and hidden is not None and hidden.shape[:2] == shard.loss_mask.shape
    assert heads == [False] and applied == []
    # and through train_on_shard: the prepare pass asks for no head, the training pass has one
    heads.clear()
    rank.train_on_shard(0, gs)
    assert heads == [False] and applied


# ---------------------------------------------------------------- where the reference and critic live


class _StubBackend:
    """A backend whose device is `meta`: the driver must take the reference's and the critic's
    device from it (nothing else decides)."""

    device = torch.device("meta")
    weights_are_live = False
    takes_block_masks = False
    head_kernel = "eager"
    keeps_logits = False
    moe = None  # a dense model
    replays_routes = False
    attention_path = "dense"

    def setup(self, model_dir: str) -> int:
        return 0

    def base_reference(self, cut, logprob_chunk_tokens: int, head_kernel: str = "eager") -> None:
        return None  # no LoRA: the driver loads the reference from the run's initial folder

    def reference_share(self) -> None:
        return None  # no sequence parallelism

    def hf_weights(self) -> dict[str, torch.Tensor]:
        return {}  # the weight source's served checksum is never asked for here

    def served_weights(self) -> dict[str, torch.Tensor]:
        return {}


def test_reference_and_critic_take_the_backends_device(model_dir, monkeypatch):
    monkeypatch.setattr(driver_mod, "make_backend", lambda *a, **k: _StubBackend())
    rank = LearnerDriver(settings(model_dir, algorithm=AlgorithmConfig(name="ppo", kl_coef=0.1)), 0, 1, "", [])
    rank.setup()
    assert {p.device.type for p in rank.algo.reference.model.parameters()} == {"meta"}
    assert {p.device.type for p in rank.algo.critic.head.parameters()} == {"meta"}


def test_reference_and_critic_on_the_real_backends_device(model_dir):
    rank = make_rank(model_dir, algorithm=AlgorithmConfig(name="ppo", kl_coef=0.1))
    dev = rank.backend.device
    assert {p.device for p in rank.algo.reference.model.parameters()} == {dev}
    assert {p.device for p in rank.algo.critic.head.parameters()} == {dev}
    m = rank.train_on_shard(0, groups(8))
    assert np.isfinite(m.loss) and m.value_loss > 0
    assert {p.grad.device for p in rank.algo.critic.head.parameters()} == {dev}

