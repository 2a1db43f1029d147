"""Entropy controls (algorithm.entropy_coef, algorithm.cov_control): the entropy bonus's gradient
raises the entropy and reaches the model through the chunked and the full head; Clip-Cov and KL-Cov
select the tokens the paper's rules name and act on those only; with both off the loss and its
gradient are the plain policy loss's, bit for bit."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from async_rl.config import AlgorithmConfig
from async_rl.learner.driver import LearnerDriver
from async_rl.learner.model.head import flat_index, full_token_scores, head_scores
from async_rl.learner.rl.algorithms import Algorithm, Prepared
from async_rl.learner.rl.losses import covariance_selection, policy_loss, token_covariance
from async_rl.models.tiny import resolve_model_path
from tests.unit._learner_fixtures import groups, settings

CLIP = {"eps_low": 0.2, "eps_high": 0.2, "tis_cap": 2.0}


def algorithm(**fields) -> Algorithm:
    """An Algorithm without reference model or critic (no model files needed)."""
    return Algorithm(
        AlgorithmConfig(**fields), max_tokens=8, temperature=1.0, model_dir="", dtype=torch.float32,
        hidden_size=8, seed=0, max_grad_norm=1.0,
    )


def prepared(behav: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cov_select=None) -> Prepared:
    return Prepared(
        behav_logp=behav, mask=mask, advantages=adv, prox_logp=None, ref_logp=None,
        denominator=float(mask.sum()), kl_ref=0.0, value_loss=0.0, cov_select=cov_select,
    )


@dataclass
class Shard:
    """What `Algorithm.prepare` reads of a shard for a group estimator (no model passes)."""

    behav_logp: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T]
    rewards: torch.Tensor  # [groups, n]

    @property
    def episode_rows(self) -> torch.Tensor:  # every row is an episode
        return torch.arange(self.rewards.numel())


def categorical(seed: int, b: int = 2, t: int = 5, v: int = 7):
    """Logits (a leaf), sampled targets, behaviour log-probs near the policy's, advantages, a mask."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g).requires_grad_()
    targets = torch.randint(0, v, (b, t), generator=g)
    with torch.no_grad():
        behav = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
        behav = behav + 0.05 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, t, generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.2).float()
    return logits, targets, behav, adv, mask


# ---------------------------------------------------------------- entropy bonus


def test_entropy_bonus_gradient_is_minus_coef_times_the_mean_entropy_gradient():
    logits, targets, behav, adv, mask = categorical(0)
    coef = 0.3
    grads = {}
    for c in (0.0, coef):
        logits.grad = None
        logp, entropy = full_token_scores(logits, targets, 1.0)
        loss, _ = algorithm(entropy_coef=c).loss(prepared(behav, adv, mask), logp, entropy)
        loss.backward()
        grads[c] = logits.grad.clone()
    logits.grad = None
    _, entropy = full_token_scores(logits, targets, 1.0)
    ((entropy * mask).sum() / mask.sum()).backward()
    torch.testing.assert_close(grads[coef] - grads[0.0], -coef * logits.grad, atol=1e-6, rtol=1e-5)


def test_entropy_bonus_step_raises_entropy():
    """Zero advantages: the loss is the bonus alone; a gradient step raises every masked position's
    entropy and leaves the others."""
    logits, targets, behav, _, mask = categorical(1)
    logp, entropy = full_token_scores(logits, targets, 1.0)
    before = entropy.detach().clone()
    loss, _ = algorithm(entropy_coef=0.5).loss(prepared(behav, torch.zeros_like(mask), mask), logp, entropy)
    loss.backward()
    with torch.no_grad():
        after = full_token_scores(logits - 0.5 * logits.grad, targets, 1.0)[1]
    on = mask.bool()
    assert torch.all(after[on] > before[on])
    torch.testing.assert_close(after[~on], before[~on])


def test_entropy_bonus_without_entropies_is_an_error():
    logits, targets, behav, adv, mask = categorical(2)
    logp, _ = full_token_scores(logits, targets, 1.0)
    with pytest.raises(ValueError, match="entropy_coef"):
        algorithm(entropy_coef=0.1).loss(prepared(behav, adv, mask), logp)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_chunked_head_entropy_gradient_equals_the_full_heads(temperature, chunk):
    """The chunked head's backward for a loss of log-probs and entropies equals autograd through the
    full head, also for a loss of the entropies alone."""
    torch.manual_seed(0)
    b, t, h, v = 2, 7, 12, 50
    hidden = torch.randn(b, t, h, requires_grad=True)
    weight = (0.3 * torch.randn(v, h)).requires_grad_()
    targets = torch.randint(0, v, (b, t))
    positions = torch.rand(b, t) > 0.3
    up_logp, up_entropy = torch.randn(b, t), torch.randn(b, t)
    for with_logp in (True, False):
        hidden.grad = weight.grad = None
        logp, entropy = head_scores(hidden, weight, targets, flat_index(positions), temperature, chunk)
        ((logp * up_logp if with_logp else 0) + entropy * up_entropy).sum().backward()
        chunked = hidden.grad.clone(), weight.grad.clone()
        hidden.grad = weight.grad = None
        full_logp, full_entropy = full_token_scores(hidden @ weight.t(), targets, temperature)
        ((full_logp * up_logp if with_logp else 0) + full_entropy * up_entropy)[positions].sum().backward()
        torch.testing.assert_close(chunked[0], hidden.grad, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(chunked[1], weight.grad, atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return resolve_model_path("tiny-qwen2", str(tmp_path_factory.mktemp("models")))


def test_learner_entropy_bonus_raises_the_policy_entropy(model_dir):
    """Through the torch backend (chunked head), four steps on the same batch: the policy gradient
    alone collapses the entropy (3.83 -> 2.61 on this tiny model, whose entropy starts near its
    maximum); with a strong bonus it stays near where it started."""
    curves = {}
    for coef in (0.0, 1.0):
        rank = LearnerDriver(settings(model_dir, algorithm=AlgorithmConfig(entropy_coef=coef)), 0, 1, "", [])
        rank.setup()
        gs = groups(5, n_groups=2)
        curves[coef] = [rank.train_on_shard(i, gs).entropy for i in range(4)]  # each before its update
    start = curves[0.0][0]
    assert curves[1.0][0] == start
    assert curves[0.0][-1] < start - 0.5
    assert curves[1.0][-1] > curves[0.0][-1] + 0.5 and curves[1.0][-1] > start - 0.3


# ---------------------------------------------------------------- covariance and selection


def test_token_covariance_hand_values():
    old = torch.tensor([[-1.0, -3.0, -2.0], [-0.5, -9.0, -2.5]])
    adv = torch.tensor([[1.0], [-1.0]])  # per sequence, broadcast over tokens
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    # Over the 5 masked tokens: mean A = 1/5, mean log-prob = -9/5.
    want = torch.tensor([[0.8 * 0.8, 0.8 * -1.2, 0.8 * -0.2], [-1.2 * 1.3, 0.0, -1.2 * -0.7]])
    torch.testing.assert_close(token_covariance(old, adv, mask), want)


def test_token_covariance_means_are_global_over_ranks():
    """`reduce` sums the rank's (count, sum A, sum log-prob): the centring uses the global means."""
    old = torch.tensor([[-1.0, -2.0]])
    adv = torch.tensor([[1.0, 0.0]])
    mask = torch.ones(1, 2)
    other_rank = torch.tensor([2.0, -3.0, -9.0], dtype=torch.float64)  # 2 tokens, sum A -3, sum logp -9
    cov = token_covariance(old, adv, mask, reduce=lambda x: x + other_rank)
    mean_a, mean_lp = (1.0 - 3.0) / 4, (-3.0 - 9.0) / 4
    torch.testing.assert_close(cov, torch.tensor([[(1 - mean_a) * (-1 - mean_lp), (0 - mean_a) * (-2 - mean_lp)]]))


COV = torch.tensor([[0.5, 1.5, 4.9, 6.0, 2.0], [3.0, -2.0, 1.0, 2.5, 1.2]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
IN_RANGE = {(0, 1), (0, 2), (1, 0), (1, 3), (1, 4)}  # 1 < cov < 5 on the mask ((0, 4) is masked out)


def chosen(sel: torch.Tensor) -> set[tuple[int, int]]:
    return {tuple(i) for i in sel.nonzero().tolist()}


def test_clip_cov_takes_every_token_in_range_when_the_ratio_allows():
    sel = covariance_selection(COV, MASK, "clip_cov", ratio=1.0, low=1.0, high=5.0)
    assert chosen(sel) == IN_RANGE


@pytest.mark.parametrize("ratio,count", [(0.25, 2), (0.01, 1)])  # int(ratio * 9 loss tokens), at least 1
def test_clip_cov_takes_a_random_subset_of_the_range(ratio, count):
    subsets = set()
    for seed in range(12):
        sel = covariance_selection(
            COV, MASK, "clip_cov", ratio, 1.0, 5.0, generator=torch.Generator().manual_seed(seed)
        )
        picked = chosen(sel)
        assert len(picked) == count and picked <= IN_RANGE
        subsets.add(frozenset(picked))
    assert len(subsets) > 1  # uniform among the in-range tokens, not the top ones


def test_kl_cov_takes_exactly_the_highest_covariances():
    assert chosen(covariance_selection(COV, MASK, "kl_cov", ratio=0.25)) == {(0, 3), (0, 2)}  # 6.0, 4.9
    assert chosen(covariance_selection(COV, MASK, "kl_cov", ratio=0.01)) == {(0, 3)}


# ---------------------------------------------------------------- what the selected tokens get


def loss_grad(**kw):
    logits, targets, behav, adv, mask = categorical(3)
    logp = full_token_scores(logits, targets, 1.0)[0].detach().requires_grad_()
    loss, _, stats = policy_loss(logp, behav, adv, mask, **CLIP, **kw)
    loss.backward()
    return loss, logp.grad, stats, logp.detach(), behav, mask


def test_clip_cov_detaches_exactly_the_selected_tokens():
    sel = torch.zeros(2, 5)
    sel[0, 1] = sel[1, 3] = 1.0
    loss0, grad0, _, _, _, mask = loss_grad()
    loss1, grad1, stats, *_ = loss_grad(clip_cov=sel)
    assert loss1 == loss0  # the value is unchanged; only the gradient
    assert torch.all(grad1[sel.bool()] == 0) and torch.all(grad0[sel.bool() & mask.bool()] != 0)
    assert torch.equal(grad1[~sel.bool()], grad0[~sel.bool()])
    assert stats.cov_frac == pytest.approx(float((sel * mask).sum() / mask.sum()))


def test_kl_cov_penalises_exactly_the_selected_tokens():
    sel = torch.zeros(2, 5)
    sel[0, 2] = sel[1, 0] = 1.0
    coef = 0.7
    loss0, grad0, _, logp, behav, mask = loss_grad()
    loss1, grad1, stats, *_ = loss_grad(kl_cov=sel, kl_cov_coef=coef)
    delta = logp - behav
    penalty = coef * ((delta.abs() * sel * mask).sum() / mask.sum())
    torch.testing.assert_close(loss1 - loss0, penalty)
    # |log pi - log pi_old|: gradient coef * sign(delta) / denominator on the selected tokens only.
    torch.testing.assert_close(grad1 - grad0, coef * torch.sign(delta) * sel * mask / mask.sum())
    assert stats.cov_frac == pytest.approx(float((sel * mask).sum() / mask.sum()))


@pytest.mark.parametrize("control", ["clip_cov", "kl_cov"])
def test_controls_act_through_algorithm_prepare(control):
    """`prepare` selects on the batch's old log-probs and advantages; `loss` applies the selection:
    the cov_frac it reports is the selection's share of the loss tokens."""
    g = torch.Generator().manual_seed(5)
    b = Shard(
        behav_logp=-3.0 * torch.rand(4, 6, generator=g),
        loss_mask=(torch.rand(4, 6, generator=g) > 0.2).float(),
        rewards=torch.tensor([[1.0, 0.0], [0.25, 0.75]]),
    )
    algo = algorithm(cov_control=control, cov_ratio=0.3, clip_cov_low=-100.0, clip_cov_high=100.0)
    p = algo.prepare(b, lambda _h: (b.behav_logp, None))
    n_tokens = int(p.mask.sum())
    assert int(p.cov_select.sum()) == max(1, int(0.3 * n_tokens))
    assert torch.all(p.cov_select <= p.mask)
    logp = b.behav_logp.clone().requires_grad_()
    _, stats = algo.loss(p, logp)
    assert stats.cov_frac == pytest.approx(float(p.cov_select.sum()) / n_tokens)


# ---------------------------------------------------------------- off is today's loss


def test_off_is_the_plain_policy_loss_bit_for_bit():
    logits, targets, behav, adv, mask = categorical(4)
    results = []
    for run in ("plain", "algorithm", "empty selection"):
        logits.grad = None
        logp, entropy = full_token_scores(logits, targets, 1.0)
        if run == "plain":
            loss = policy_loss(logp, behav, adv, mask, **CLIP, denominator=float(mask.sum()))[0]
        elif run == "algorithm":
            assert algorithm().cfg.cov_control == "none" and algorithm().cfg.entropy_coef == 0
            loss = algorithm().loss(prepared(behav, adv, mask), logp, entropy)[0]
        else:  # a selection of no tokens changes nothing either
            zeros = torch.zeros_like(mask)
            loss = policy_loss(
                logp, behav, adv, mask, **CLIP, denominator=float(mask.sum()), clip_cov=zeros, kl_cov=zeros,
                kl_cov_coef=1.0,
            )[0]
        loss.backward()
        results.append((loss.detach(), logits.grad.clone()))
    for loss, grad in results[1:]:
        assert torch.equal(loss, results[0][0]) and torch.equal(grad, results[0][1])
