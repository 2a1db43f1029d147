"""learner.kernels on the CPU: auto keeps the eager modules, liger refuses with one line (its Triton
kernels need CUDA; the package is not installed here), compile compiles every decoder layer."""

from __future__ import annotations

import pytest
import torch

from async_rl.errors import RunError
from async_rl.learner.driver import LearnerDriver
from async_rl.learner.model import kernels
from async_rl.learner.model.kernels import apply_kernels, decoder_layers
from tests.unit._learner_fixtures import settings


def model(model_dir) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def test_auto_is_none_on_cpu_and_liger_refuses_with_one_line(model_dir):
    m = model(model_dir)
    assert apply_kernels("auto", m, torch.device("cpu")) == "none"
    assert all(layer._compiled_call_impl is None for layer in decoder_layers(m))
    with pytest.raises(RunError, match=r"^learner.kernels=liger: its Triton kernels need CUDA; set") as e:
        apply_kernels("liger", m, torch.device("cpu"))
    assert "\n" not in str(e.value)
    # On CUDA the reason is the missing package (or a model Liger does not patch), not the device.
    why = kernels.liger_unavailable(m, torch.device("cuda"))
    assert why is not None and ("liger_kernel does not import" in why or why.startswith("model_type"))
    m.config.model_type = "gpt2"
    assert kernels.liger_unavailable(m, torch.device("cuda")).startswith("model_type 'gpt2'")


def test_kernels_compile_compiles_the_decoder_layers_of_the_model_the_forward_runs_on(model_dir):
    r = LearnerDriver(settings(model_dir, kernels="compile", mixed_precision="bf16_params"), 0, 1, "", [])
    r.setup()
    assert r.backend.kernels == "compile"
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(r.backend.working.module))
    assert all(layer._compiled_call_impl is None for layer in decoder_layers(r.backend.model))  # the masters
