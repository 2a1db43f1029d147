"""Shared helpers for learner unit tests: a tiny model folder, settings, synthetic shards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from async_rl.config import (
    AlgorithmConfig,
    GeneratorConfig,
    LearnerConfig,
    ModelConfig,
    TrainConfig,
    WeightSyncConfig,
)
from async_rl.config.spec import LearnerSpec
from async_rl.learner.batch.padded import PaddedShard
from async_rl.learner.driver import LearnerDriver
from async_rl.protocol import TrajectoryGroup

LEARNER_FIELDS = set(LearnerConfig.__struct_fields__)
TRAIN_FIELDS = {"minibatches", "epochs", "max_nonfinite_steps", "deterministic"}


def settings(model_dir, **overrides) -> LearnerSpec:
    """A learner spec for tests: `overrides` name LearnerConfig fields, `algorithm`, `total_steps`,
    `seed`, `minibatches`, `epochs`, `max_nonfinite_steps`, `max_tokens`, `temperature` or
    `reference_model_dir`."""
    learner = {"lr": 1e-2, "weight_decay": 0.01, "max_grad_norm": 1.0}
    learner.update({k: v for k, v in overrides.items() if k in LEARNER_FIELDS})
    train = {k: v for k, v in overrides.items() if k in TRAIN_FIELDS}
    rest = {k: v for k, v in overrides.items() if k not in LEARNER_FIELDS and k not in TRAIN_FIELDS}
    return LearnerSpec(
        model=ModelConfig(path=str(model_dir), dtype="float32"),
        learner=LearnerConfig(**learner),
        algorithm=rest.pop("algorithm", AlgorithmConfig()),
        generators=GeneratorConfig(max_tokens=rest.pop("max_tokens", 8), temperature=rest.pop("temperature", 1.0)),
        train=TrainConfig(total_steps=rest.pop("total_steps", 10), seed=rest.pop("seed", 0), **train),
        weight_sync=WeightSyncConfig(backend="gloo", bucket_mb=1, host="127.0.0.1", timeout_s=10.0),
        run_id="test",
        model_dir=str(model_dir),
        reference_model_dir=str(rest.pop("reference_model_dir", model_dir)),
        buffer_address="tcp://127.0.0.1:1",
        batch_timeout_s=1.0,
        **rest,
    )


def make_rank(model_dir, by_cost: bool = True, **overrides) -> LearnerDriver:
    """A one-rank learner driver on `model_dir`, set up (`overrides`: as for `settings`; `by_cost` False:
    micro-batches cut by tokens alone, a comparison)."""
    rank = LearnerDriver(settings(model_dir, **overrides), 0, 1, "", [], by_cost=by_cost)
    rank.setup()
    return rank


def groups(seed: int, n_groups: int = 2, group_size: int = 3, vocab: int = 40) -> list[TrajectoryGroup]:
    """Prompts and completions of different lengths (so padding and packing differ), varied rewards."""
    rng = np.random.default_rng(seed)
    out = []
    for gi in range(n_groups):
        prompt = rng.integers(3, vocab, size=int(rng.integers(2, 6))).astype(np.int32)
        comps = [rng.integers(3, vocab, size=int(rng.integers(1, 7))).astype(np.int32) for _ in range(group_size)]
        out.append(
            TrajectoryGroup(
                prompt_id=gi,
                engine_id=0,
                prompt_tokens=prompt,
                completions=comps,
                logprobs=[(-3.0 + 0.1 * rng.standard_normal(len(c))).astype(np.float32) for c in comps],
                rewards=[float(r) for r in rng.random(group_size)],
                version_first=[0] * group_size,
                version_last=[0] * group_size,
                reward_status=[0] * group_size,
            )
        )
    return out


def episode_groups(seed: int, n_groups: int = 3, group_size: int = 4) -> list:
    """groups() with longer prompts and multi-turn loss masks: holes (environment tokens) in the
    completions; the prompt is the episode's initial prompt."""
    gs = groups(seed, n_groups=n_groups, group_size=group_size)
    rng = np.random.default_rng(seed)
    for g in gs:
        g.prompt_tokens = np.concatenate([g.prompt_tokens, rng.integers(3, 40, 6).astype(np.int32)])
        g.loss_masks = [(rng.random(len(c)) > 0.3).astype(np.int8) for c in g.completions]
        for m in g.loss_masks:
            m[0] = 1
    return gs


def spied_step(rank: LearnerDriver, gs) -> dict:
    """One train_on_shard with spies: the training forward's log-probs and entropies per sample (in
    shard order), the gradients before the optimizer step, the proximal log-probs and hidden states
    of the scoring pass, and the step's metrics."""
    out: dict = {"logp": [], "entropy": [], "micro_batches": 0}
    backend = rank.backend
    real_fb, real_step = backend.forward_backward, backend.optimizer_step

    def forward_backward(mbs, temperature, loss_fn):
        out["micro_batches"] = len(mbs)
        out["mbs"] = mbs

        def spy(i, scores):
            out["logp"].extend(mbs[i].per_sequence(scores.logp))
            out["entropy"].extend(mbs[i].per_sequence(scores.entropy))
            return loss_fn(i, scores)

        real_fb(mbs, temperature, spy)

    def optimizer_step(lr, max_grad_norm):
        out["grads"] = {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None}
        return real_step(lr, max_grad_norm)

    backend.forward_backward, backend.optimizer_step = forward_backward, optimizer_step
    shard = PaddedShard(gs)
    out["scored"] = rank._score_padded(gs, shard, True)
    out["metrics"] = rank.train_on_shard(0, gs)
    out["mask"] = shard.loss_mask
    return out


def assert_equal_steps(a: dict, b: dict, atol: float = 1e-5) -> None:
    """`atol`: of the per-token values (log-probs, entropies, hidden states)."""
    assert len(a["logp"]) == len(b["logp"])
    for x, y in zip(a["logp"], b["logp"], strict=True):
        np.testing.assert_allclose(y, x, atol=atol, rtol=0)
    for x, y in zip(a["entropy"], b["entropy"], strict=True):
        np.testing.assert_allclose(y, x, atol=atol, rtol=0)
    (lp_a, h_a), (lp_b, h_b) = a["scored"], b["scored"]
    mask = a["mask"]
    torch.testing.assert_close(lp_b * mask, lp_a * mask, atol=atol, rtol=0)
    torch.testing.assert_close(h_b * mask[..., None], h_a * mask[..., None], atol=atol, rtol=0)
    assert a["grads"].keys() == b["grads"].keys()
    total = sum(float(g.norm() ** 2) for g in a["grads"].values()) ** 0.5
    assert total > 0
    for name, ga in a["grads"].items():
        diff = float((b["grads"][name] - ga).norm())
        # relative to the parameter's gradient (floored at a millionth of the whole gradient's norm)
        assert diff <= 1e-4 * max(float(ga.norm()), 1e-6 * total), name
    ma, mb = a["metrics"], b["metrics"]
    for field in ("loss", "kl_behav", "logprob_abs_diff", "entropy", "value_loss", "grad_norm", "cov_frac"):
        assert getattr(mb, field) == pytest.approx(getattr(ma, field), rel=1e-4, abs=1e-6), field
