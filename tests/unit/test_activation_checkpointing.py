"""learner.activation_checkpointing on the torch backend: the same step (loss, gradient norm, updated
weights) with far fewer activations kept for backward; every layer runs twice in a gradient pass.

The megatron side (full recompute) is tested in test_megatron_cpu.py."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from async_rl.config import LoraConfig
from async_rl.learner.torch_backend import decoder_layers
from tests.unit._learner_fixtures import groups, make_rank


class SavedBytes:
    """Bytes of the tensors autograd keeps for backward (each storage once), while active."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        self.storages[s.data_ptr()] = s.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def step(rank, shard, saved: SavedBytes | None = None):
    hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t) if saved else contextlib.nullcontext()
    layers = decoder_layers(rank.backend.model)
    calls = []  # layer calls started (a recompute stops once it has what backward needs: no post-hook)
    handles = [layer.register_forward_pre_hook(lambda *_: calls.append(1)) for layer in layers]
    try:
        with hooks:
            metrics = rank.train_on_shard(0, shard)
    finally:
        for h in handles:
            h.remove()
    return metrics, len(calls) / len(layers)


@pytest.mark.parametrize(
    "overrides",
    [{"share_prompt": True}, {"share_prompt": False}, {"lora": LoraConfig(enabled=True, rank=4, init="gaussian")}],
    ids=["shared_prompt", "unshared", "lora"],
)
def test_checkpointed_step_equals_the_plain_step(model_dir, overrides):
    torch.manual_seed(0)
    plain = make_rank(model_dir, **overrides)
    torch.manual_seed(0)
    ckpt = make_rank(model_dir, **overrides, activation_checkpointing=True)
    assert ckpt.backend.model.is_gradient_checkpointing and not plain.backend.model.is_gradient_checkpointing
    (m_plain, calls_plain), (m_ckpt, calls_ckpt) = step(plain, groups(0)), step(ckpt, groups(0))
    assert calls_ckpt == 2 * calls_plain  # every layer recomputed in backward
    assert m_ckpt.loss == pytest.approx(m_plain.loss, rel=1e-6, abs=1e-7)
    assert m_ckpt.grad_norm == pytest.approx(m_plain.grad_norm, rel=1e-5)
    for (name, a), (_, b) in zip(plain.backend.model.named_parameters(), ckpt.backend.model.named_parameters(),
                                 strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0, msg=name)
    after = [np.concatenate(r.compute_logprobs(groups(1), 1.0)) for r in (plain, ckpt)]
    np.testing.assert_allclose(after[1], after[0], atol=1e-6, rtol=0)


def test_checkpointing_keeps_a_fraction_of_the_activations(model_dir):
    """What autograd holds for backward: each layer's input instead of all its intermediates."""
    shard = groups(0, n_groups=4, group_size=4)
    saved = {}
    for on in (False, True):
        torch.manual_seed(0)
        rank = make_rank(model_dir, activation_checkpointing=on)
        bytes_ = SavedBytes()
        step(rank, shard, bytes_)
        # The parameters themselves are saved by reference in both; count what is not a parameter.
        params = {p.untyped_storage().data_ptr() for p in rank.backend.model.parameters()}
        saved[on] = sum(n for ptr, n in bytes_.storages.items() if ptr not in params)
    assert 0 < saved[True] < 0.5 * saved[False], saved
