"""learner.compile and learner.mixed_precision on the CPU: the switches change speed, not the values
beyond their numerics (compile: fp32 reordering; bf16 autocast: bf16 rounding of the matmuls)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from async_rl.learner.driver import LearnerDriver
from async_rl.learner.torch_backend import decoder_layers
from tests.unit._learner_fixtures import groups, settings


def rank(model_dir, **learner) -> LearnerDriver:
    torch.manual_seed(0)
    r = LearnerDriver(settings(model_dir, **learner), 0, 1, "", [])
    r.setup()
    return r


def flat(values: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(values)


def test_compiled_layers_give_the_eager_log_probs_loss_and_update(model_dir):
    eager, compiled = rank(model_dir), rank(model_dir, compile=True)
    layers = decoder_layers(compiled.backend.model)
    assert layers and all(layer._compiled_call_impl is not None for layer in layers)  # compiled, not eager
    assert all(layer._compiled_call_impl is None for layer in decoder_layers(eager.backend.model))
    # The loss is of the log-probs (equal loss: equal log-probs), its gradient norm of their gradients.
    m_eager, m_compiled = (r.train_on_shard(0, groups(0)) for r in (eager, compiled))
    assert m_compiled.loss == pytest.approx(m_eager.loss, rel=1e-4, abs=1e-6)
    assert m_compiled.grad_norm == pytest.approx(m_eager.grad_norm, rel=1e-4)
    # The no-grad scoring graph, another batch shape, the weights after the update.
    after = [flat(r.compute_logprobs(groups(1, n_groups=3), 1.0)) for r in (eager, compiled)]
    np.testing.assert_allclose(after[1], after[0], atol=1e-4, rtol=0)


def test_bf16_autocast_log_probs_are_fp32_within_bf16_rounding(model_dir):
    fp32, bf16 = rank(model_dir, mixed_precision="none"), rank(model_dir, mixed_precision="bf16")
    a, b = (flat(r.compute_logprobs(groups(0), 1.0)) for r in (fp32, bf16))
    diff = np.abs(a - b)
    assert diff.max() > 0  # autocast ran: bf16 matmuls round
    # bf16 keeps 8 mantissa bits (relative 2^-8 = 0.4%): a log-prob of a few nats moves by ~0.01.
    assert diff.mean() < 0.02 and diff.max() < 0.1
    assert bf16.backend.model.dtype == torch.float32  # master weights stay fp32
    m32, m16 = fp32.train_on_shard(0, groups(0)), bf16.train_on_shard(0, groups(0))
    assert m16.loss == pytest.approx(m32.loss, rel=0.05, abs=1e-3)
    assert m16.grad_norm == pytest.approx(m32.grad_norm, rel=0.05)
