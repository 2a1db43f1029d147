"""Checkpoints of megatron's distributed optimizer keep its per-parameter state: one optimizer step
after a save and a load (through files, as MegatronBackend.save/load write them) equals the same
step without them. Its `state_dict` alone leaves Adam's moments out (the load fills them with
`torch.empty`).

In bfloat16 too, for a model with qkv biases (Qwen2) and one without (Llama): before every
parameter was built in the model's dtype, the local spec's fp32 norms shared the no-weight-decay
group with Qwen2's bf16 biases, megatron-core 0.16.1 keyed that group's state by a stale index
(Megatron-LM #2777) and the load crashed ("size of tensor a (256) must match ... (128)"), as on the
GPU.

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
from tests.unit._megatron_models import fixed_batch, one_rank_model_parallel, tiny_llama, tiny_qwen2  # noqa: E402

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


CASES = {
    "float32-qwen2": (torch.float32, tiny_qwen2),
    "bfloat16-qwen2-biases": (torch.bfloat16, tiny_qwen2),
    "bfloat16-llama-no-biases": (torch.bfloat16, tiny_llama),
}


@pytest.fixture(scope="module")
def model_parallel():
    with one_rank_model_parallel():
        yield


@pytest.fixture(scope="module", params=sorted(CASES))
def trained(request, model_parallel, tmp_path_factory):
    """A policy after one step (weights and both optimizer files saved), then after a second step;
    `make(weights)` builds a fresh policy with the same settings."""
    from async_rl.learner.megatron.learner import MegatronPolicy

    dtype, build = CASES[request.param]
    with distributed_optimizer_on_cpu():
        hf = build()
        arch = mcv.arch_from_hf_config(hf.config)

        def make(weights):
            return MegatronPolicy(
                arch, weights, dtype=dtype, lr=1e-2, weight_decay=0.0, max_grad_norm=1.0,
                distributed_optimizer=True, te_spec=False, cpu_init=True,
            )

        policy = make(dict(hf.named_parameters()))
        built = (dtype, {p.dtype for p in policy.model.parameters()})
        b = fixed_batch(arch.vocab_size)
        b.behav_logp = policy.logprobs(b.input_ids).detach().float() * b.loss_mask
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

        yield unbroken, step_after_load, built


def test_a_step_after_save_and_load_equals_the_unbroken_step(trained):
    """Moments, fp32 main weights and Adam's step restored (each parameter its own `step`: shared,
    as megatron's load leaves it under torch's Adam, the step lands up to 4e-3 away)."""
    unbroken, step_after_load, _ = trained
    resumed = step_after_load(with_parameter_state=True)
    assert list(resumed) == list(unbroken)
    for name, want in unbroken.items():
        assert torch.allclose(resumed[name], want, rtol=0, atol=1e-7), (name, (resumed[name] - want).abs().max())


def test_the_optimizer_state_dict_alone_loses_the_moments(trained):
    """What the checkpoint held before: the same step then lands elsewhere."""
    unbroken, step_after_load, _ = trained
    resumed = step_after_load(with_parameter_state=False)
    assert not all(torch.allclose(resumed[n], want, rtol=0, atol=1e-4) for n, want in unbroken.items())


def test_every_parameter_is_built_in_the_model_dtype(trained):
    """Without Transformer Engine too (torch's RMSNorm ignores megatron's `params_dtype`)."""
    _, _, (dtype, dtypes) = trained
    assert dtypes == {dtype}


def test_a_parameter_of_another_dtype_is_refused_in_one_line():
    """The distributed optimizer's guard: a model that mixes dtypes fails at start-up, not on the
    first resume."""
    from async_rl.learner.megatron.model import check_single_dtype

    model = torch.nn.Sequential(torch.nn.Linear(4, 4).to(torch.bfloat16), torch.nn.LayerNorm(4))
    with pytest.raises(RuntimeError, match=r"^megatron: 2 parameters are not torch.bfloat16 \(first: 1.bias") as e:
        check_single_dtype(model, torch.bfloat16)
    assert "\n" not in str(e.value)
    check_single_dtype(model.to(torch.bfloat16), torch.bfloat16)
