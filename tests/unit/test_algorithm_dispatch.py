"""`Algorithm` (config -> advantages and loss) on the tiny model: each name wires the right estimator,
the decoupled objective recomputes proximal log-probs, the reference starts equal to the policy, and
the PPO critic learns its value targets."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from async_rl.config import AlgorithmConfig
from async_rl.learner.rl.advantages import dr_grpo_advantages, grpo_advantages, rloo_advantages
from async_rl.learner.rl.algorithms import Algorithm, score_tokens, token_logprobs

MAX_TOKENS = 4


@dataclass
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    behav_logp: torch.Tensor
    loss_mask: torch.Tensor
    rewards: torch.Tensor

    @property
    def episode_rows(self) -> torch.Tensor:  # every row is an episode
        return torch.arange(self.rewards.numel())


@pytest.fixture(scope="module")
def policy(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def make_batch(policy) -> Batch:
    """2 groups x 2 samples: 2 prompt tokens, completions of 3, 4, 2, 4 tokens (padded to 4)."""
    g = torch.Generator().manual_seed(0)
    lengths = [3, 4, 2, 4]
    ids = torch.randint(3, 40, (4, 6), generator=g)
    attn = torch.zeros(4, 6, dtype=torch.long)
    mask = torch.zeros(4, 5)
    for i, n in enumerate(lengths):
        attn[i, : 2 + n] = 1
        mask[i, 1 : 1 + n] = 1
    b = Batch(ids, attn, torch.zeros(4, 5), mask, torch.tensor([[1.0, 0.0], [0.25, 0.75]]))
    b.behav_logp = score_tokens(policy, b, 1.0)[0] * mask  # on-policy: vLLM's log-probs = the learner's
    return b


def algorithm(model_dir, **cfg) -> Algorithm:
    return Algorithm(
        AlgorithmConfig(**cfg),
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        model_dir=str(model_dir),
        dtype=torch.float32,
        hidden_size=128,
        seed=0,
        max_grad_norm=1.0,
    )


def scorer(policy, b: Batch):
    """The algorithm's view of the policy: no-grad log-probs (and hidden states) on `b`."""
    return lambda with_hidden: score_tokens(policy, b, 1.0, with_hidden)


def trained_logp(policy, b: Batch) -> torch.Tensor:
    logits = policy(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1]
    return token_logprobs(logits, b.input_ids[:, 1:])


@pytest.mark.parametrize(
    "name, estimator", [("grpo", grpo_advantages), ("dr_grpo", dr_grpo_advantages), ("rloo", rloo_advantages)]
)
def test_group_estimators_per_sequence(model_dir, policy, name, estimator):
    b = make_batch(policy)
    algo = algorithm(model_dir, name=name)
    p = algo.prepare(b, scorer(policy, b))
    assert torch.equal(p.advantages, estimator(b.rewards).reshape(-1, 1))
    assert p.prox_logp is None and p.ref_logp is None  # no extra passes by default
    assert p.denominator == (4 * MAX_TOKENS if name == "dr_grpo" else 13)  # 3 + 4 + 2 + 4 tokens
    loss, stats = algo.loss(p, trained_logp(policy, b))
    # on-policy, r = 1: loss = -sum(A over tokens) / denominator
    tokens = b.loss_mask.sum(dim=1)
    want = -(p.advantages.flatten() * tokens).sum() / p.denominator
    assert loss.item() == pytest.approx(want.item(), abs=1e-5)
    assert stats.clip_frac == 0.0 and stats.masked_frac == 0.0 and stats.value_loss == 0.0


def test_reinforce_pp_whitens_returns_over_the_batch(model_dir, policy):
    b = make_batch(policy)
    p = algorithm(model_dir, name="reinforce_pp").prepare(b, scorer(policy, b))
    a, m = p.advantages, b.loss_mask
    assert a.shape == m.shape
    assert (a * m).sum().item() == pytest.approx(0.0, abs=1e-5)
    assert ((a * a * m).sum() / m.sum()).item() == pytest.approx(1.0, abs=1e-5)
    # gamma 1 and no KL: every token of a sequence has its sequence's (whitened) reward
    r = b.rewards.reshape(-1)
    for i in range(4):
        vals = a[i][m[i] > 0]
        assert torch.allclose(vals, vals[0].expand_as(vals))
    assert a[0][1].item() > a[3][1].item() > a[2][1].item() > a[1][1].item()  # order of 1, .75, .25, 0
    assert r.tolist() == [1.0, 0.0, 0.25, 0.75]


def test_decoupled_recomputes_proximal_logprobs(model_dir, policy):
    b = make_batch(policy)
    b.behav_logp = (b.behav_logp - 0.1) * b.loss_mask  # vLLM's policy: a little off
    algo = algorithm(model_dir, objective="decoupled")
    p = algo.prepare(b, scorer(policy, b))
    torch.testing.assert_close(p.prox_logp * b.loss_mask, score_tokens(policy, b, 1.0)[0] * b.loss_mask)
    _, stats = algo.loss(p, trained_logp(policy, b))
    assert stats.clip_frac == 0.0  # pi == pi_prox before the update
    assert stats.logprob_abs_diff == pytest.approx(0.1, abs=1e-5)


def test_reference_starts_at_the_policy_and_kl_grows_when_it_moves(model_dir, policy):
    b = make_batch(policy)
    algo = algorithm(model_dir, kl_coef=0.5)
    assert algo.reference is not None
    p = algo.prepare(b, scorer(policy, b))
    loss, stats = algo.loss(p, trained_logp(policy, b))
    assert stats.kl_ref == pytest.approx(0.0, abs=1e-6)
    moved = algo.reference.model.__class__(algo.reference.model.config)
    moved.load_state_dict(policy.state_dict())
    with torch.no_grad():
        moved.lm_head.weight.mul_(1.5)  # tied to the embeddings: a different policy
    loss_moved, stats_moved = algo.loss(p, trained_logp(moved, b))
    assert stats_moved.kl_ref > 1e-3
    assert loss_moved.item() == pytest.approx(stats_moved.policy_loss + 0.5 * stats_moved.kl_ref, abs=1e-5)
    # the reference itself is frozen
    assert not any(p.requires_grad for p in algo.reference.model.parameters())


def test_kl_in_reward_changes_token_rewards(model_dir, policy):
    b = make_batch(policy)
    b.behav_logp = (b.behav_logp - 0.2) * b.loss_mask  # the sampler drifted from the reference
    plain = algorithm(model_dir, name="reinforce_pp").prepare(b, scorer(policy, b))
    penalised = algorithm(
        model_dir, name="reinforce_pp", kl_coef=0.5, kl_in_reward=True, kl_estimator="k1"
    ).prepare(b, scorer(policy, b))
    assert penalised.ref_logp is None  # in the reward, not in the loss
    assert penalised.kl_ref == pytest.approx(-0.2, abs=1e-5)  # k1 of mu against ref = mu - ref
    assert not torch.allclose(plain.advantages, penalised.advantages)


def test_ppo_critic_learns_the_returns(model_dir, policy):
    b = make_batch(policy)
    algo = algorithm(model_dir, name="ppo", critic_lr=1e-2)
    losses = [algo.prepare(b, scorer(policy, b)).value_loss for _ in range(60)]
    # V starts at 0, so the first targets are the lambda-returns R * lambda^(tokens to the end) (gamma 1)
    returns = torch.tensor(
        [r * 0.95**k for r, n in zip([1.0, 0.0, 0.25, 0.75], [3, 4, 2, 4], strict=True) for k in range(n)]
    )
    assert losses[0] == pytest.approx(0.5 * (returns**2).mean().item(), rel=1e-4)
    assert losses[-1] < 0.2 * losses[0]
    p = algo.prepare(b, scorer(policy, b))
    assert (p.advantages * b.loss_mask).sum().item() == pytest.approx(0.0, abs=1e-4)  # whitened
    assert set(algo.state_dict()) == {"critic"}


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "reinforce_pp"])
def test_micro_batch_losses_add_up_to_the_shard_loss(model_dir, policy, name):
    b = make_batch(policy)
    b.behav_logp = (
        b.behav_logp + 0.3 * torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    ) * b.loss_mask
    algo = algorithm(model_dir, name=name, kl_coef=0.1, ratio_mask_low=0.8, ratio_mask_high=1.25)
    p = algo.prepare(b, scorer(policy, b))
    logp = trained_logp(policy, b)
    whole, stats = algo.loss(p, logp)
    assert stats.masked_frac > 0  # some tokens are dropped for their ratio, and still the parts add up
    parts = [algo.loss(p.rows(sl), logp[sl])[0] for sl in (slice(0, 1), slice(1, 3), slice(3, 4))]
    assert sum(parts).item() == pytest.approx(whole.item(), abs=1e-6)
