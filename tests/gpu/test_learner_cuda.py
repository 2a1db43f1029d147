"""Torch learner on CUDA: bf16 compute with fp32 weights (autocast for DDP, MixedPrecisionPolicy for
FSDP2), the loss goes down on a fixed shard, and checkpoints load back (marked gpu; skipped without CUDA)."""

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


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_bf16_training_on_cuda(model_dir, tmp_path, parallel):
    s = settings(model_dir, parallel=parallel, mixed_precision="auto", lr=1e-3, micro_batch_size=3)
    rank = LearnerDriver(s, 0, 1, f"127.0.0.1:{free_port()}", [])
    rank.setup()
    assert rank.device.type == "cuda" and rank.backend._compute_dtype() == torch.bfloat16
    shard = groups(1, n_groups=4, group_size=4)
    losses = [rank.train_on_shard(k, shard).loss for k in range(6)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in rank.backend.model.parameters())  # master weights stay fp32
    rank.save_checkpoint(str(tmp_path))
    rank.gather_weights()
    before = {n: t.detach().cpu().clone() for n, t in rank.hf_weights().items()}
    assert rank.load_checkpoint(str(tmp_path)) == 6
    rank.gather_weights()
    for name, t in rank.hf_weights().items():
        assert torch.equal(t.detach().cpu(), before[name]), name
    rank.shutdown()


def test_reference_and_critic_live_on_the_learners_device(model_dir):
    """KL reference and PPO critic on the learner's own device (checked by device type against the
    backend's device), and a PPO + KL step runs there (a CPU critic all-reduced over NCCL crashed)."""
    from async_rl.config import AlgorithmConfig

    algo = AlgorithmConfig(name="ppo", kl_coef=0.05)
    s = settings(model_dir, algorithm=algo, mixed_precision="auto", micro_batch_size=3)
    rank = LearnerDriver(s, 0, 1, f"127.0.0.1:{free_port()}", [])
    rank.setup()
    try:
        assert rank.device.type == "cuda"
        ref = rank.algo.reference.model
        assert {p.device.type for p in ref.parameters()} == {rank.device.type}
        assert {p.device.type for p in rank.algo.critic.head.parameters()} == {rank.device.type}
        m = rank.train_on_shard(0, groups(2, n_groups=2, group_size=4))
        assert torch.isfinite(torch.tensor(m.loss))
    finally:
        rank.shutdown()
