"""train.deterministic on CUDA, the learner's half: two fresh learner ranks train the same batches
from the same weights in bf16 compute and end with bit-identical parameters (deterministic
algorithms, a fixed cuBLAS workspace). The engines' half (VLLM_BATCH_INVARIANT=1) needs vLLM, which
the device image lacks: unverified there (docs/determinism.md)."""

from __future__ import annotations

import pytest
import torch

from async_rl.cluster.net import free_port
from async_rl.learner.driver import LearnerDriver
from async_rl.models.tiny import resolve_model_path
from tests.unit._learner_fixtures import groups, settings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return resolve_model_path("tiny-qwen2", str(tmp_path_factory.mktemp("models")))


def trained(model_dir, deterministic: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    s = settings(model_dir, device="cuda", mixed_precision="auto", lr=1e-3, micro_batch_size=3,
                 deterministic=deterministic)
    rank = LearnerDriver(s, 0, 1, f"127.0.0.1:{free_port()}", [])
    rank.setup()
    try:
        losses = [rank.train_on_shard(k, groups(k, n_groups=4, group_size=4)).loss for k in range(4)]
        rank.gather_weights()
        return losses, {n: t.detach().cpu().clone() for n, t in rank.hf_weights().items()}
    finally:
        rank.shutdown()


def test_two_deterministic_learners_end_with_the_same_bits(model_dir):
    try:
        first, second = trained(model_dir, True), trained(model_dir, True)
    finally:
        torch.use_deterministic_algorithms(False)  # process-wide: the other GPU tests run as they always did
    assert first[0] == second[0]
    differing = [n for n, t in first[1].items() if not torch.equal(t, second[1][n])]
    assert not differing, differing
