"""The torch learner: LR schedule, packed vs padded batches, micro-batch accumulation, checkpoints."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from async_rl.learner.base import checkpoint_model_dir
from async_rl.learner.batch.packing import SeqSample, pack_rows, packed, padded, split
from async_rl.learner.driver import shard_samples
from async_rl.learner.schedule import lr_factor
from tests.unit._learner_fixtures import groups, make_rank

# ---------------------------------------------------------------- LR schedule


def test_lr_warmup_then_cosine_to_floor():
    f = [lr_factor(k, 2, 6, "cosine", 0.1) for k in range(6)]
    assert f[0] == pytest.approx(0.5) and f[1] == pytest.approx(1.0)
    # cosine from 1 at step 2 to 0.1 at the last step (5): progress k-2 over 3
    for k in range(2, 6):
        assert f[k] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (k - 2) / 3)))
    assert f[-1] == pytest.approx(0.1)


def test_lr_linear_and_constant():
    assert [lr_factor(k, 0, 5, "linear", 0.0) for k in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert [lr_factor(k, 3, 5, "constant", 0.0) for k in range(5)] == pytest.approx([1 / 3, 2 / 3, 1, 1, 1])


def test_learner_applies_schedule(model_dir):
    rank = make_rank(model_dir, lr=1e-2, lr_warmup_steps=2, lr_decay="linear", total_steps=4)
    used = [rank.train_on_shard(k, groups(k)).lr for k in range(4)]
    assert used == pytest.approx([5e-3, 1e-2, 1e-2, 0.0])  # warmup, then 1 -> 0


# ---------------------------------------------------------------- packing


def test_split_respects_sequence_and_token_limits():
    samples = [SeqSample(np.arange(n), 1, np.zeros(n - 1, np.float32), np.zeros(n - 1, np.float32)) for n in (3, 4, 5, 9)]
    assert [len(c) for c in split(samples, 2, 0)] == [2, 2]
    assert [[len(s.tokens) for s in c] for c in split(samples, 0, 8)] == [[3, 4], [5], [9]]
    assert [len(c) for c in split(samples, 0, 0)] == [4]


def test_pack_rows_first_fit_bounded():
    # width 10: 6+4 share row 0, 7 opens row 1, 3 fills it, 12 (over the width) fills a row alone, 2 opens one
    assert pack_rows([6, 7, 4, 3, 12, 2], 10) == [0, 1, 0, 1, 2, 3]
    assert pack_rows([5, 5, 5], 5) == [0, 1, 2]


def prepared_samples(model, model_dir, gs, **algorithm):
    from async_rl.config import AlgorithmConfig
    from async_rl.learner.batch.padded import PaddedShard as Collated
    from async_rl.learner.rl.algorithms import Algorithm, score_tokens

    algo = Algorithm(
        AlgorithmConfig(**algorithm), max_tokens=8, temperature=1.0, model_dir=str(model_dir), dtype=torch.float32,
        hidden_size=model.config.hidden_size, seed=0, max_grad_norm=1.0,
    )
    b = Collated(gs)
    return shard_samples(gs, algo.prepare(b, lambda h: score_tokens(model, b, 1.0, h)))


def test_padded_preparation_reaches_packed_micro_batches(model_dir):
    """The algorithm prepares on padded rows; its per-token values must land on the right tokens of
    the packed row. With the decoupled objective the proximal log-probs are the current weights'
    log-probs, so the packed forward must reproduce them token by token."""
    from transformers import AutoModelForCausalLM

    from async_rl.learner.rl.algorithms import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gs = groups(1, n_groups=2, group_size=3)
    samples = prepared_samples(model, model_dir, gs, objective="decoupled")
    mb = packed(samples)
    assert mb.prox_logp is not None and mb.ref_logp is None
    with torch.no_grad():
        logp = token_logprobs(model(**mb.model_inputs(torch.device("cpu"))).logits, mb.targets)
    for s, lp, prox in zip(samples, mb.per_sequence(logp), mb.per_sequence(mb.prox_logp), strict=True):
        np.testing.assert_allclose(lp, s.prox_logp, atol=2e-5, rtol=0)
        np.testing.assert_array_equal(prox, s.prox_logp)
    # GRPO advantages: one value per completion, broadcast over its tokens, group by group
    rewards = [r for g in gs for r in g.rewards]
    per_seq = [float(s.advantages[0]) for s in samples]
    assert all(np.all(s.advantages == s.advantages[0]) for s in samples)
    best = int(np.argmax(rewards[:3]))
    assert per_seq[best] == max(per_seq[:3]) > 0


def test_packed_logprobs_equal_padded(model_dir):
    from transformers import AutoModelForCausalLM

    from async_rl.learner.rl.algorithms import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    samples = prepared_samples(model, model_dir, groups(0, n_groups=3, group_size=4))
    lengths = {len(s.tokens) for s in samples}
    assert len(lengths) > 1  # padding really happens in the padded layout
    longest = max(lengths)
    layouts = [packed(samples), packed(samples, row_tokens=2 * longest), packed(samples, row_tokens=10_000),
               padded(samples)]
    # rows of the longest sequence hold several short ones; one wide row holds them all
    assert layouts[0].input_ids.shape[1] == longest and layouts[0].input_ids.shape[0] < len(samples)
    assert layouts[1].input_ids.shape[1] <= 2 * longest and layouts[2].input_ids.shape[0] == 1
    results = []
    for mb in layouts:
        with torch.no_grad():
            logits = model(**mb.model_inputs(torch.device("cpu"))).logits
        results.append(mb.per_sequence(token_logprobs(logits, mb.targets)))
    padded_lp = results[-1]
    for packed_lp in results[:-1]:
        assert [len(a) for a in packed_lp] == [s.completion_len for s in samples]
        for a, b in zip(packed_lp, padded_lp, strict=True):
            np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)
    packed_lp = results[0]
    # and each equals the sequence scored alone (no cross-sequence attention in the packed row)
    for s, a in zip(samples, packed_lp, strict=True):
        alone = packed([s])
        with torch.no_grad():
            logits = model(**alone.model_inputs(torch.device("cpu"))).logits
        np.testing.assert_allclose(alone.per_sequence(token_logprobs(logits, alone.targets))[0], a, atol=2e-5, rtol=0)


def test_packed_and_micro_batched_training_match_one_padded_batch(model_dir):
    shard = groups(3, n_groups=2, group_size=4)
    ref = make_rank(model_dir, packing=False)
    m_ref = ref.train_on_shard(0, shard)
    acc = make_rank(model_dir, packing=True, micro_batch_size=3)
    m_acc = acc.train_on_shard(0, shard)
    assert m_ref.micro_batches == 1 and m_acc.micro_batches == 3
    assert m_acc.loss == pytest.approx(m_ref.loss, abs=1e-6)
    assert m_acc.grad_norm == pytest.approx(m_ref.grad_norm, rel=1e-5)
    # gradients (kept after the step) agree; parameters after AdamW would amplify float noise in
    # near-zero gradients to full-size steps, so they are not the thing to compare
    for (name, a), (_, b) in zip(acc.backend.model.named_parameters(), ref.backend.model.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-7, rtol=1e-4, msg=name)


# ---------------------------------------------------------------- checkpoints


def _state_equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_state_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_state_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def test_checkpoint_round_trip_is_bit_exact(model_dir, tmp_path):
    a = make_rank(model_dir, lr_warmup_steps=1, lr_decay="cosine", total_steps=6)
    for k in range(2):
        a.train_on_shard(k, groups(10 + k))
    torch.rand(3)  # move the RNG away from its seed
    a.save_checkpoint(str(tmp_path))
    after_save = torch.rand(4)
    b = make_rank(model_dir, lr_warmup_steps=1, lr_decay="cosine", total_steps=6)
    assert b.load_checkpoint(str(tmp_path)) == 2
    assert _state_equal(a.backend.optimizer.state_dict(), b.backend.optimizer.state_dict())
    assert a.step_count == b.step_count == 2  # the LR schedule is a function of the step count
    for (name, p), (_, q) in zip(a.backend.model.named_parameters(), b.backend.model.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    # the RNG streams continue identically: the draw after a load is the draw after the save
    a.load_checkpoint(str(tmp_path))
    assert torch.equal(torch.rand(4), after_save)
    b.load_checkpoint(str(tmp_path))
    assert torch.equal(torch.rand(4), after_save)
    # and the next step is the same step
    ma, mb = a.train_on_shard(2, groups(12)), b.train_on_shard(2, groups(12))
    assert ma.lr == mb.lr and ma.loss == mb.loss
    for (name, p), (_, q) in zip(a.backend.model.named_parameters(), b.backend.model.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_checkpoint_model_folder_loads_with_transformers(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rank = make_rank(model_dir)
    rank.train_on_shard(0, groups(5))
    rank.save_checkpoint(str(tmp_path))
    folder = checkpoint_model_dir(tmp_path)
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok("a:").input_ids
    # tied embeddings: stored once, and the loaded output layer is the trained input embedding
    assert loaded.config.tie_word_embeddings
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[5, 9, 12, 7, 30, 4]])
    with torch.no_grad():
        ours = rank.backend.model(input_ids=ids).logits
        theirs = loaded(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, atol=0, rtol=0)


def test_compute_logprobs_scores_every_completion_token(model_dir):
    """The learner interface's no-grad scoring: one array per completion, equal to the model's
    log-probs of those tokens after the prompt."""
    from transformers import AutoModelForCausalLM

    rank = make_rank(model_dir)
    gs = groups(5, n_groups=2, group_size=3)
    got = rank.compute_logprobs(gs)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    completions = [(g.prompt_tokens, c) for g in gs for c in g.completions]
    assert len(got) == len(completions)
    for (prompt, comp), lp in zip(completions, got, strict=True):
        ids = torch.from_numpy(np.concatenate([prompt, comp]).astype(np.int64))[None]
        with torch.no_grad():
            full = torch.log_softmax(model(ids).logits[0].float(), -1)
        want = full[len(prompt) - 1 : -1].gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
        assert lp.dtype == np.float32 and lp.shape == (len(comp),)
        np.testing.assert_allclose(lp, want.numpy(), atol=2e-5, rtol=0)


def test_batch_without_signal_takes_no_optimizer_step(model_dir):
    """All groups uniform (GRPO advantages all 0): the weights and AdamW's state stay as they are. An
    AdamW step on the zero gradient would still move the weights along the previous step's momentum
    and shrink the second moment (the collapse of converged quickstart runs)."""
    import dataclasses

    rank = make_rank(model_dir)
    rank.train_on_shard(0, groups(7))  # a real step: AdamW has momentum now
    before = {n: p.detach().clone() for n, p in rank.backend.model.named_parameters()}
    state = {n: s["exp_avg_sq"].clone() for n, s in zip(before, rank.backend.optimizer.state.values(), strict=True)}
    uniform = [dataclasses.replace(g, rewards=[1.0] * len(g.rewards)) for g in groups(8)]
    m = rank.train_on_shard(1, uniform)
    assert m.grad_norm == 0.0 and m.samples == 6
    for n, p in rank.backend.model.named_parameters():
        assert torch.equal(p, before[n]), n
    for n, s in zip(before, rank.backend.optimizer.state.values(), strict=True):
        assert torch.equal(s["exp_avg_sq"], state[n]), n
    assert rank.step_count == 2  # the step still counts (policy version, LR schedule)


class _Batches:
    """The buffer's side of `train_step` for a rank driven without a buffer: hands over one shard."""

    def __init__(self, shard) -> None:
        self.shard = shard

    def fetch(self, step: int, timeout_s: float):
        return self.shard


def test_gather_weights_waits_for_the_optimizer_step(model_dir):
    """A weight gather issued while train_step is inside its optimizer step runs only after the step
    (the weights lock), and a gather for the version the step just replaced gathers nothing."""
    import threading

    rank = make_rank(model_dir)
    rank.batches = _Batches(groups(3))
    order: list[str] = []
    in_step, calling, gathered = threading.Event(), threading.Event(), threading.Event()
    step, gather = rank.backend.optimizer_step, rank.backend.gather_weights

    def optimizer_step(lr, max_grad_norm):
        order.append("step begins")
        in_step.set()
        calling.wait(timeout=30)
        gathered.wait(timeout=2.0)  # without the lock the gather lands here, inside the step
        out = step(lr, max_grad_norm)
        order.append("step ends")
        return out

    def backend_gather():
        order.append("gather")
        gathered.set()
        gather()

    rank.backend.optimizer_step = optimizer_step
    rank.backend.gather_weights = backend_gather
    results: list[bool] = []

    def recovery_sync():
        in_step.wait(timeout=30)
        calling.set()
        results.append(rank.gather_weights(0))  # the version the step is replacing
        results.append(rank.gather_weights(1))

    t = threading.Thread(target=recovery_sync)
    t.start()
    rank.train_step(0)
    t.join(timeout=30)
    assert order == ["step begins", "step ends", "gather"]
    assert results == [False, True] and rank.version == 1
