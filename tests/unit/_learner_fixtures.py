"""Shared helpers for learner unit tests: a tiny model folder, settings, synthetic shards."""

from __future__ import annotations

import numpy as np

from async_rl.config import AlgorithmConfig
from async_rl.learner.base import LearnerSettings
from async_rl.protocol import TrajectoryGroup


def settings(model_dir, **overrides) -> LearnerSettings:
    base = dict(
        model_dir=str(model_dir), dtype="float32", lr=1e-2, weight_decay=0.01, max_grad_norm=1.0,
        algorithm=AlgorithmConfig(), max_tokens=8, temperature=1.0, seed=0, run_id="test",
        buffer_address="tcp://127.0.0.1:1", batch_timeout_s=1.0, bucket_mb=1, weight_sync_host="127.0.0.1",
        weight_sync_port=0, weight_sync_timeout_s=10.0, weight_sync_backend="gloo", weight_checksum="sampled",
        wire_dtype="", total_steps=10,
    )
    base.update(overrides)
    return LearnerSettings(**base)


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
