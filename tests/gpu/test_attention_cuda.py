"""GPU tier, part A: the torch learner's attention kernels (learner/model/attention.py) on CUDA.

- varlen (torch's varlen flash attention) and flex (compiled FlexAttention) in bf16 score within the
  bf16 tolerance of the fp32 dense-mask SDPA reference, no further from it than SDPA in bf16 is, and
  their gradients point the same way; packed and padded, with and without shared prompts,
  multi-turn holes, temperature != 1. This checks what the CPU tier cannot: the kernels themselves,
  flash's causal alignment of a suffix's queries with its prefix + suffix keys, flex's backward.
- flex in fp32 equals the fp32 dense path (values and gradients), and new packed lengths do not
  recompile it.
- The backend's choice: `auto` runs varlen on CUDA under bf16 autocast (shared prompts too).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from async_rl.config import LearnerConfig
from async_rl.learner.batch.packing import SeqSample, micro_batches
from async_rl.learner.batch.shared_prefix import shared_micro_batches
from async_rl.learner.model.attention import KernelChoice, register
from async_rl.learner.model.head import flat_index, model_scores
from tests.gpu._gpu_util import model_dir_or_skip

CUDA = torch.device("cuda", 0)


def samples(seed: int = 0, groups: int = 4, size: int = 4) -> list[SeqSample]:
    """Groups of samples sharing a prompt, multi-turn holes in their loss masks."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(groups):
        prompt = rng.integers(3, 40, int(rng.integers(8, 30)))
        for _ in range(size):
            comp = rng.integers(3, 40, int(rng.integers(4, 60)))
            mask = (rng.random(len(comp)) > 0.3).astype(np.float32)
            mask[0] = 1
            out.append(SeqSample(np.concatenate([prompt, comp]), len(prompt), np.zeros(len(comp), np.float32),
                                 np.zeros(len(comp), np.float32), loss_mask=mask))
    return out


def layouts() -> dict:
    s = samples()
    return {
        "packed": micro_batches(s, True, row_tokens=128)[0],
        "padded": micro_batches(s, False)[0],
        "shared_packed": shared_micro_batches(s, True, row_tokens=256)[0],
        "shared_padded": shared_micro_batches(s, False)[0],
    }


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir_or_skip("tiny-qwen2"), dtype=torch.float32).to(CUDA)
    return m


def run(model, mb, kernel: str, bf16: bool):
    """(log-probs at the span positions, flattened gradient) of a weighted loss on log-probs and entropy."""
    model.set_attn_implementation("sdpa" if kernel == "sdpa" else register())
    model.zero_grad(set_to_none=True)
    mb = mb.to(CUDA)
    at = mb.span_positions()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        logp, entropy, _ = model_scores(model, mb.model_inputs(CUDA, KernelChoice(kernel, kernel)), mb.targets, flat_index(at),
                                        0.7, 64)
    w = torch.linspace(0.5, 1.5, logp.numel(), device=CUDA).view_as(logp) * mb.loss_mask
    ((logp * w).sum() + 0.1 * (entropy * w).sum()).backward()
    grad = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    return logp.detach()[at].float(), grad


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


@pytest.mark.parametrize("kernel", ["varlen", "flex"])
def test_bf16_kernels_stay_within_sdpa_s_bf16_tolerance_of_fp32(model, kernel):
    for name, mb in layouts().items():
        ref, ref_grad = run(model, mb, "sdpa", bf16=False)
        sdpa, sdpa_grad = run(model, mb, "sdpa", bf16=True)
        got, grad = run(model, mb, kernel, bf16=True)
        base = float((sdpa - ref).abs().mean())
        diff = float((got - ref).abs().mean())
        print(f"{kernel} {name}: mean |bf16 - fp32| {diff:.2e} (sdpa bf16 {base:.2e}); gradient cosine "
              f"{cosine(grad, ref_grad):.5f} (sdpa bf16 {cosine(sdpa_grad, ref_grad):.5f})")
        assert torch.isfinite(got).all() and torch.isfinite(grad).all()
        assert diff < 0.05 and diff <= 2 * base + 1e-3, name
        assert cosine(grad, ref_grad) > 0.99 and cosine(grad, ref_grad) >= cosine(sdpa_grad, ref_grad) - 0.01, name


def test_flex_in_fp32_equals_the_dense_path_values_and_gradients(model):
    for name, mb in layouts().items():
        ref, ref_grad = run(model, mb, "sdpa", bf16=False)
        got, grad = run(model, mb, "flex", bf16=False)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0, msg=name)
        assert float((grad - ref_grad).norm()) <= 1e-3 * float(ref_grad.norm()), name


def test_flex_does_not_recompile_for_new_packed_lengths(model):
    from torch._dynamo.utils import counters

    s = samples(seed=3, groups=6)
    mbs = [micro_batches(s[: 4 * k], True, row_tokens=128)[0] for k in (2, 4, 6)]  # three total lengths
    assert len({mb.input_ids.numel() for mb in mbs}) == 3
    run(model, mbs[0], "flex", bf16=True)  # the first shape compiles
    before = counters["stats"]["unique_graphs"]
    for mb in mbs[1:]:
        run(model, mb, "flex", bf16=True)
    assert counters["stats"]["unique_graphs"] - before <= 1  # at most the switch to a dynamic graph


def test_auto_trains_with_varlen_under_bf16_autocast():
    from async_rl.learner.torch_backend import TorchBackend

    backend = TorchBackend(LearnerConfig(attention="auto"), "float32", 0, 1, "127.0.0.1:0")
    backend.setup(model_dir_or_skip("tiny-qwen2"))
    assert backend.attention_kernels == KernelChoice("varlen", "varlen")
    for mb in layouts().values():
        mb = mb.to(backend.device)
        backend.forward_backward([mb], 0.7, lambda i, sc, mask=mb.loss_mask: -(sc.logp * mask).sum())
        assert all(torch.isfinite(p.grad).all() for p in backend.model.parameters() if p.grad is not None)
