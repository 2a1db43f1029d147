"""`learner.head_kernel: auto` measured at start-up (learner/model/head_probe.py): every kernel that can run
is timed on the given output layer and the fastest is chosen; a kernel that cannot run or raises is
reported and never chosen; ranks agree on the slowest rank's times; the output layer is left as it
was; on the CPU the torch backend measures nothing and runs eager."""

from __future__ import annotations

import math

import pytest
import torch

from async_rl.learner.model import head_fused, head_probe
from async_rl.learner.model.head_probe import HeadProbe, measure


@pytest.fixture
def weight():
    return torch.randn(300, 24, generator=torch.Generator().manual_seed(0)) * 0.1


def test_every_kernel_that_runs_is_timed_and_the_fastest_is_chosen(weight, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    before = weight.clone()
    probe = measure(weight, chunk=16, dtype=torch.float32, kernels=("eager", "compiled", "triton"), repeats=2)
    assert set(probe.seconds) == {"eager", "compiled"}
    assert all(0 < s < math.inf for s in probe.seconds.values())
    assert probe.fastest == min(probe.seconds, key=probe.seconds.get)
    # triton needs CUDA (or its interpreter): reported with the reason, not chosen
    assert "CUDA" in probe.failed["triton"]
    assert (probe.positions, probe.vocab) == (32, 300)
    torch.testing.assert_close(weight, before, rtol=0, atol=0)  # the model's layer: untouched, no gradient
    assert weight.grad is None
    line = probe.line()
    assert line.startswith(f"learner.head_kernel auto: {probe.fastest}, the fastest here")
    assert "eager" in line and "compiled" in line and "not run: triton:" in line


def test_a_kernel_that_raises_is_reported_and_not_chosen(weight, monkeypatch):
    def broken():
        raise RuntimeError("inductor could not build it\nsecond line")

    monkeypatch.setattr(head_fused, "compiled", broken)
    probe = measure(weight, chunk=8, dtype=torch.float32, kernels=("compiled", "eager"), repeats=1)
    assert list(probe.seconds) == ["eager"] and probe.fastest == "eager"
    assert probe.failed == {"compiled": "RuntimeError: inductor could not build it"}


def test_the_fastest_is_the_smallest_time_and_eager_when_nothing_ran():
    assert HeadProbe(8, 10, {"eager": 3e-3, "compiled": 1e-3, "triton": 2e-3}).fastest == "compiled"
    assert HeadProbe(8, 10, {}, {"compiled": "x"}).fastest == "eager"


def test_ranks_agree_on_the_slowest_ranks_times():
    """Two ranks measured differently: each takes, per kernel, the larger time (here an all-reduce
    max over the two, as the backend's is), so both choose the same kernel; a kernel that failed on
    one rank is dropped on both."""
    ranks = [
        HeadProbe(8, 10, {"eager": 5e-3, "compiled": 1e-3, "triton": 4e-3}),
        HeadProbe(8, 10, {"eager": 5e-3, "compiled": 9e-3}, {"triton": "triton does not import"}),
    ]
    vectors = [torch.tensor([p.seconds.get(n, math.inf) for n in head_probe.FUSED], dtype=torch.float64) for p in ranks]

    def reduce_max(x: torch.Tensor) -> torch.Tensor:
        assert x.dtype == torch.float64 and x.shape == (len(head_probe.FUSED),)
        return torch.stack(vectors).amax(0)

    agreed = [p.agreed(reduce_max) for p in ranks]
    assert [a.seconds for a in agreed] == [{"eager": 5e-3, "compiled": 9e-3}] * 2
    assert [a.fastest for a in agreed] == ["eager", "eager"]
    assert agreed[0].failed == {"triton": "failed on another rank"}
    assert agreed[1].failed == {"triton": "triton does not import"}


def test_the_torch_backend_measures_nothing_on_the_cpu_and_the_reference_runs_its_kernel(model_dir):
    """auto on the CPU: eager, no probe; the driver hands the backend's kernel to the KL reference."""
    from async_rl.cluster.net import free_port
    from async_rl.config import AlgorithmConfig
    from async_rl.learner.driver import LearnerDriver
    from tests.unit._learner_fixtures import settings

    for setting, kernel in (("auto", "eager"), ("compiled", "compiled")):
        rank = LearnerDriver(settings(model_dir, algorithm=AlgorithmConfig(kl_coef=0.05), head_kernel=setting),
                             0, 1, f"127.0.0.1:{free_port()}", [])
        rank.setup()
        try:
            assert rank.backend.head_probe is None
            assert rank.backend.head_kernel == kernel
            assert rank.algo.reference.fused is head_probe.FUSED[kernel]
        finally:
            rank.shutdown()


def test_the_line_names_how_a_kernel_with_choices_ran():
    probe = HeadProbe(2048, 151936, {"eager": 3e-3, "triton": 1e-3}, {}, {"triton": "BLOCK 8192, 16 warps"})
    assert "triton 1.00 ms (BLOCK 8192, 16 warps), eager 3.00 ms" in probe.line()
    assert probe.agreed(lambda x: x).configs == probe.configs
