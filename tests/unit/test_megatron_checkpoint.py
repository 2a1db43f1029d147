"""Checkpoints of megatron's distributed optimizer keep its per-parameter state: one optimizer step
after a save and a load (through files, as MegatronBackend.save/load write them) equals the same
step without them. Its `state_dict` alone leaves Adam's moments out (the load fills them with
`torch.empty`).

One gloo rank on CPU (DP=1: the state is this rank's whole shard). megatron's DistributedOptimizer
checks `param.type() == "torch.cuda.FloatTensor"` when it builds its parameter groups; everything
else it does runs under the learner.megatron.cpu patches, so these tests report CPU float32
tensors as CUDA ones to that check. Multi-rank (DP > 1) shards run on GPU only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from async_rl.learner.megatron import convert as mcv  # noqa: E402
from async_rl.learner.megatron import cpu as megatron_cpu  # noqa: E402
from async_rl.learner.megatron.backend import load_parameter_state, parameter_state  # noqa: E402
from tests.unit._megatron_models import fixed_batch, one_rank_model_parallel, tiny_qwen2  # noqa: E402

_tensor_type = torch.Tensor.type


def _cpu_as_cuda_type(self: torch.Tensor, *args, **kwargs):
    name = _tensor_type(self, *args, **kwargs)
    if args or kwargs or self.device.type != "cpu":
        return name
    return name.replace("torch.", "torch.cuda.", 1)


@contextlib.contextmanager
def distributed_optimizer_on_cpu() -> Iterator[None]:
    with megatron_cpu.patched(), mock.patch.object(torch.Tensor, "type", _cpu_as_cuda_type):
        yield


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A policy after one step (weights and both optimizer files saved), then after a second step;
    `make(weights)` builds a fresh policy with the same settings."""
    from async_rl.learner.megatron.learner import MegatronPolicy

    with one_rank_model_parallel(), distributed_optimizer_on_cpu():
        hf = tiny_qwen2()
        arch = mcv.arch_from_hf_config(hf.config)

        def make(weights):
            return MegatronPolicy(
                arch, weights, dtype=torch.float32, lr=1e-2, weight_decay=0.0, max_grad_norm=1.0,
                distributed_optimizer=True, te_spec=False, cpu_init=True,
            )

        policy = make(dict(hf.named_parameters()))
        b = fixed_batch(arch.vocab_size)
        b.behav_logp = policy.logprobs(b.input_ids).detach() * b.loss_mask
        policy.train_batch(b, 2, 1.0, 0.2, 0.2, 2.0)
        saved = {n: t.clone() for n, t in policy.hf_state_dict().items()}
        root = tmp_path_factory.mktemp("ckpt")
        torch.save(policy.optimizer.state_dict(), root / "optimizer.pt")
        torch.save(parameter_state(policy.optimizer), root / "parameter_state.pt")
        policy.train_batch(b, 2, 1.0, 0.2, 0.2, 2.0)
        unbroken = policy.hf_state_dict()

        def step_after_load(with_parameter_state: bool) -> dict[str, torch.Tensor]:
            resumed = make(saved)
            resumed.optimizer.load_state_dict(torch.load(root / "optimizer.pt", weights_only=False))
            if with_parameter_state:
                load_parameter_state(resumed.optimizer, torch.load(root / "parameter_state.pt", weights_only=False))
            resumed.train_batch(b, 2, 1.0, 0.2, 0.2, 2.0)
            return resumed.hf_state_dict()

        yield unbroken, step_after_load


def test_a_step_after_save_and_load_equals_the_unbroken_step(trained):
    """Moments, fp32 main weights and Adam's step restored (each parameter its own `step`: shared,
    as megatron's load leaves it under torch's Adam, the step lands up to 4e-3 away)."""
    unbroken, step_after_load = trained
    resumed = step_after_load(with_parameter_state=True)
    assert list(resumed) == list(unbroken)
    for name, want in unbroken.items():
        assert torch.allclose(resumed[name], want, rtol=0, atol=1e-7), (name, (resumed[name] - want).abs().max())


def test_the_optimizer_state_dict_alone_loses_the_moments(trained):
    """What the checkpoint held before: the same step then lands elsewhere."""
    unbroken, step_after_load = trained
    resumed = step_after_load(with_parameter_state=False)
    assert not all(torch.allclose(resumed[n], want, rtol=0, atol=1e-4) for n, want in unbroken.items())
