"""On CUDA: the bf16 working copy against autocast and fp32, the fused head's fp32-output
GEMM against the CPU's, kernels=compile, and a step at the `micro_batch_tokens: auto` budget within
the GPU's memory (marked gpu; skipped without CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from async_rl.cluster.net import free_port
from async_rl.learner.driver import LearnerDriver
from async_rl.learner.model.head import flat_index, head_scores
from async_rl.models.tiny import resolve_model_path
from tests.unit._learner_fixtures import groups, settings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return resolve_model_path("tiny-qwen2", str(tmp_path_factory.mktemp("models")))


def rank(model_dir, **learner) -> LearnerDriver:
    torch.manual_seed(0)
    r = LearnerDriver(settings(model_dir, **learner), 0, 1, f"127.0.0.1:{free_port()}", [])
    r.setup()
    return r


def test_working_copy_is_autocast_within_bf16_rounding_of_fp32(model_dir):
    runs = {m: rank(model_dir, mixed_precision=m) for m in ("none", "bf16", "bf16_params")}
    assert runs["bf16_params"].backend.working is not None  # auto would pick it too
    lp = {m: np.concatenate(r.compute_logprobs(groups(0), 1.0)) for m, r in runs.items()}
    autocast, working = np.abs(lp["bf16"] - lp["none"]), np.abs(lp["bf16_params"] - lp["none"])
    print(f"vs fp32: autocast mean {autocast.mean():.2e} max {autocast.max():.2e}; "
          f"working copy mean {working.mean():.2e} max {working.max():.2e}")
    assert working.mean() < 0.05 and working.max() < 0.3
    steps = {m: r.train_on_shard(0, groups(0)) for m, r in runs.items()}
    assert steps["bf16_params"].grad_norm == pytest.approx(steps["none"].grad_norm, rel=0.1)
    for r in runs.values():
        r.shutdown()


def test_fp32_output_gemm_head_equals_the_cpu_head():
    torch.manual_seed(0)
    hidden = torch.randn(2, 40, 64)
    weight = 0.3 * torch.randn(1000, 64)
    targets = torch.randint(0, 1000, (2, 40))
    positions = torch.rand(2, 40) > 0.3
    grads = {}
    for device in ("cpu", "cuda"):
        h = hidden.to(device, torch.bfloat16).requires_grad_()
        w = weight.to(device, torch.bfloat16).requires_grad_()
        logp, _ = head_scores(h, w, targets.to(device), flat_index(positions.to(device)), 1.0, 16)
        logp.sum().backward()
        grads[device] = w.grad.float().cpu()
    torch.testing.assert_close(grads["cuda"], grads["cpu"], atol=2e-2, rtol=2e-2)


def test_kernels_compile_and_the_auto_budget_train_within_memory(model_dir):
    r = rank(model_dir, kernels="compile", micro_batch_tokens="auto")
    total = torch.cuda.mem_get_info()[1]
    assert 1024 <= r.micro_batch_tokens
    torch.cuda.reset_peak_memory_stats()
    m = r.train_on_shard(0, groups(1, n_groups=4, group_size=4))
    assert np.isfinite(m.loss) and torch.cuda.max_memory_allocated() < 0.9 * total
    r.shutdown()


def test_a_liger_model_leaves_later_models_in_the_process_their_own_modules(model_dir):
    """Liger's patch rebinds the HF modeling module's norm and MLP classes and its RoPE function; a
    model built later in the same process with kernels none keeps HF's (learner/model/kernels.py)."""
    pytest.importorskip("liger_kernel")
    from transformers.models.qwen2 import modeling_qwen2

    def module_names(r: LearnerDriver) -> set[str]:
        model = r.backend.working.module if r.backend.working is not None else r.backend.model
        # Liger patches instances: its forward and its name (`_get_name`) on HF's classes
        return {m._get_name() for m in model.modules()}

    liger = rank(model_dir, kernels="liger")
    assert "LigerRMSNorm" in module_names(liger) and "LigerSwiGLUMLP" in module_names(liger)
    plain = rank(model_dir, kernels="none")
    assert {"Qwen2RMSNorm", "Qwen2MLP"} <= module_names(plain)
    assert not {"LigerRMSNorm", "LigerSwiGLUMLP"} & module_names(plain)
    assert modeling_qwen2.apply_rotary_pos_emb.__module__ == modeling_qwen2.__name__
    for r in (liger, plain):
        r.shutdown()
