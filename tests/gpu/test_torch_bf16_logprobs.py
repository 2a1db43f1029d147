"""GPU tier, part A: the torch learner's bf16 compute (autocast over fp32 master weights, its CUDA
default) scores tokens close to its own fp32 scoring, on the tiny model and on smollm2-135m when the
preset is in the model cache. This is the learner's side of the bf16 mismatch the logprob_mismatch
column shows (vLLM's bf16 kernels add their own)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from async_rl.config import LearnerConfig
from async_rl.learner.batch.packing import SeqSample, micro_batches
from async_rl.learner.torch_backend import TorchBackend
from tests.gpu._gpu_util import model_dir_or_skip

# mean |bf16 - fp32| per token; bf16 keeps 8 bits of mantissa, logits of a few units: ~1e-2
TOLERANCE = {"tiny-qwen2": 0.05, "smollm2-135m": 0.1}


def samples(vocab: int, seed: int = 0) -> list[SeqSample]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(6):
        n_prompt, n_comp = int(rng.integers(4, 12)), int(rng.integers(8, 40))
        tokens = rng.integers(3, min(vocab, 5000), size=n_prompt + n_comp)
        out.append(SeqSample(tokens, n_prompt, np.zeros(n_comp, np.float32), np.zeros(n_comp, np.float32)))
    return out


def scores(backend: TorchBackend, batch) -> torch.Tensor:
    out = []
    for mb in batch:
        logp = backend.score(mb, temperature=1.0).logp.float().cpu()
        out.append(logp[mb.loss_mask.bool()])
    return torch.cat(out)


@pytest.mark.parametrize("name", ["tiny-qwen2", "smollm2-135m"])
def test_bf16_logprobs_stay_close_to_fp32(name):
    path = model_dir_or_skip(name)
    got = {}
    for mode in ("bf16", "none"):
        backend = TorchBackend(LearnerConfig(mixed_precision=mode), "float32", 0, 1, "127.0.0.1:0")
        backend.setup(path)
        assert backend.device.type == "cuda"
        assert backend._compute_dtype() == (torch.bfloat16 if mode == "bf16" else None)
        batch = micro_batches(samples(int(backend.model.config.vocab_size)), pack=True, max_tokens=4096)
        got[mode] = scores(backend, batch)
        assert all(p.dtype == torch.float32 for p in backend.model.parameters())  # fp32 master weights
        del backend
        torch.cuda.empty_cache()
    diff = (got["bf16"] - got["none"]).abs()
    print(f"{name}: mean |bf16 - fp32| {diff.mean():.2e}, max {diff.max():.2e} over {diff.numel()} tokens")
    assert torch.isfinite(got["bf16"]).all()
    assert 0 < diff.mean() < TOLERANCE[name]  # bf16 really ran (not 0), and stays close
