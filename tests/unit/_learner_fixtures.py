"""Shared helpers for learner unit tests: a tiny model folder, settings, synthetic shards."""

from __future__ import annotations

import numpy as np

from async_rl.config import (
    AlgorithmConfig,
    GeneratorConfig,
    LearnerConfig,
    ModelConfig,
    TrainConfig,
    WeightSyncConfig,
)
from async_rl.learner.base import LearnerSpec
from async_rl.learner.driver import LearnerDriver
from async_rl.protocol import TrajectoryGroup

LEARNER_FIELDS = set(LearnerConfig.__struct_fields__)
TRAIN_FIELDS = {"minibatches", "epochs", "max_nonfinite_steps"}


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


def make_rank(model_dir, **overrides) -> LearnerDriver:
    """A one-rank learner driver on `model_dir`, set up (`overrides`: as for `settings`)."""
    rank = LearnerDriver(settings(model_dir, **overrides), 0, 1, "", [])
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
