"""The torch learner's attention kernels (learner/model/attention.py, `learner.attention`) on CPU.

- The layout built from the segment table (position ids, the dense SDPA mask) equals the host-built
  one: the packing's position ids, HF's packed-sequence mask, the shared-prefix block mask.
- Every kernel's log-probs equal the dense-mask SDPA path where it runs (fp32, max abs < 1e-5):
  varlen through its CPU reference (per-sequence SDPA, the flash kernel's contract), flex forward
  only (torch has no CPU backward for it); packed and padded, with and without shared prompts,
  multi-turn holes, temperature != 1. Varlen's gradients too (relative < 1e-4), and a whole learner
  step with it equals the SDPA step. The kernels themselves run under tests/gpu.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from async_rl.config import AlgorithmConfig
from async_rl.errors import RunError
from async_rl.learner.batch.packing import micro_batches
from async_rl.learner.batch.shared_prefix import shared_micro_batches
from async_rl.learner.driver import shard_samples
from async_rl.learner.model import attention
from async_rl.learner.model.attention import KernelChoice, dense_mask, position_ids, register, resolve
from async_rl.learner.model.head import flat_index, model_scores
from tests.unit._learner_fixtures import assert_equal_steps, episode_groups, make_rank, spied_step

CPU = torch.device("cpu")


def layouts(seed: int = 5) -> dict:
    """One micro-batch of each layout over the same samples (multi-turn loss-mask holes; rows narrow
    enough that packed rows hold several sequences, or several blocks)."""
    samples = shard_samples(episode_groups(seed, n_groups=3, group_size=3))
    return {
        "packed": micro_batches(samples, True, row_tokens=40)[0],
        "padded": micro_batches(samples, False)[0],
        "shared_packed": shared_micro_batches(samples, True, row_tokens=60)[0],
        "shared_padded": shared_micro_batches(samples, False)[0],
    }


# ---------------------------------------------------------------- device-built == host-built


def host_block_mask(mb) -> torch.Tensor:
    """The former host construction: per-position labels (segment, its prefix segment) by plain
    loops over the segment table, then causal & (same segment | onto its prefix)."""
    seg = mb.segments
    labels, prefix_of = [], []
    for i, (n, p) in enumerate(zip(seg.lengths.tolist(), seg.prefix.tolist(), strict=True)):
        labels += [i] * n
        prefix_of += [p] * n
    lab = torch.tensor(labels).view(seg.rows, seg.width)
    pre = torch.tensor(prefix_of).view(seg.rows, seg.width)
    t = seg.width
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return (causal & ((lab[:, :, None] == lab[:, None, :]) | (pre[:, :, None] == lab[:, None, :]))).unsqueeze(1)


@pytest.mark.parametrize("name", ["packed", "shared_packed", "shared_padded"])
def test_device_built_positions_equal_the_host_built(name):
    mb = layouts()[name]
    assert torch.equal(position_ids(mb.segments), mb.position_ids)


def test_device_built_masks_equal_the_host_built():
    mbs = layouts()
    for name in ("shared_packed", "shared_padded"):
        assert torch.equal(dense_mask(mbs[name].segments), host_block_mask(mbs[name])), name
    # packed rows: HF's own mask from the host position ids (what SDPA ran before)
    from transformers.masking_utils import find_packed_sequence_indices

    mb = mbs["packed"]
    seq = find_packed_sequence_indices(mb.position_ids)
    t = mb.input_ids.shape[1]
    hf = (torch.ones(t, t, dtype=torch.bool).tril() & (seq[:, :, None] == seq[:, None, :])).unsqueeze(1)
    assert torch.equal(dense_mask(mb.segments), hf)
    assert not mb.segments.shares_prefixes and mbs["shared_packed"].segments.shares_prefixes


def test_the_varlen_key_index_reads_each_suffix_s_prefix_then_itself():
    seg = layouts()["shared_packed"].segments
    keys = attention.key_index(seg).tolist()
    starts = (torch.cumsum(seg.lengths, 0) - seg.lengths).tolist()
    expected = []
    for s, (n, p) in enumerate(zip(seg.lengths.tolist(), seg.prefix.tolist(), strict=True)):
        if p >= 0:
            expected += list(range(starts[p], starts[p] + seg.lengths[p].item()))
        expected += list(range(starts[s], starts[s] + n))
    assert keys == expected and len(keys) == seg.key_tokens


# ---------------------------------------------------------------- kernels == the dense path


@pytest.fixture(scope="module")
def model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def scores(model, mb, kernel: str, grad: bool = False):
    """(log-probs [B, T], entropies, parameter gradients of a loss on both) under `kernel`."""
    model.set_attn_implementation("sdpa" if kernel == "sdpa" else register())
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grad):
        logp, entropy, _ = model_scores(model, mb.model_inputs(CPU, KernelChoice(kernel, kernel)), mb.targets, mb.span_index(), 0.7, 16)
    grads = None
    if grad:
        w = torch.linspace(0.5, 1.5, logp.numel()).view_as(logp) * mb.loss_mask
        ((logp * w).sum() + 0.1 * (entropy * w).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), entropy.detach(), grads


@pytest.mark.parametrize("kernel", ["varlen", "flex"])
def test_every_kernel_scores_equal_the_dense_path(model, kernel):
    for name, mb in layouts().items():
        ref_logp, ref_ent, _ = scores(model, mb, "sdpa")
        logp, ent, _ = scores(model, mb, kernel)
        at = mb.span_positions()
        assert at.sum() > 0
        torch.testing.assert_close(logp[at], ref_logp[at], atol=1e-5, rtol=0, msg=f"{kernel} {name}")
        torch.testing.assert_close(ent[at], ref_ent[at], atol=1e-5, rtol=0, msg=f"{kernel} {name}")


def test_the_device_built_sdpa_inputs_equal_the_former_host_ones(model):
    """The SDPA path: device-built positions (packed) and block mask (shared) give the same log-probs
    as the host-built position ids and mask did."""
    for name in ("packed", "shared_packed"):
        mb = layouts()[name]
        former = {"input_ids": mb.input_ids, "position_ids": mb.position_ids, "use_cache": False}
        if mb.segments.shares_prefixes:
            former["attention_mask"] = host_block_mask(mb)
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            a, _, _ = model_scores(model, former, mb.targets, mb.span_index(), 0.7, 16)
        b, _, _ = scores(model, mb, "sdpa")
        assert torch.equal(a, b), name


def test_the_registered_implementation_without_a_layout_is_hf_sdpa(model):
    """A forward without our layout (the LoRA base reference's padded rows) gets HF's padding mask:
    left-padded rows here, where a missing mask would let tokens see the padding."""
    mb = layouts()["padded"]
    shift = [int(n) for n in (mb.attention_mask.shape[1] - mb.attention_mask.sum(1))]

    def left(x: torch.Tensor) -> torch.Tensor:
        return torch.stack([row.roll(k) for row, k in zip(x, shift, strict=True)])

    assert max(shift) > 0
    inputs = {"input_ids": left(mb.input_ids), "attention_mask": left(mb.attention_mask), "use_cache": False}
    targets, at = left(mb.targets), left(mb.span_positions())
    out = {}
    for impl in ("sdpa", register()):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out[impl], _, _ = model_scores(model, inputs, targets, flat_index(at), 0.7, 16)
    assert torch.equal(out["sdpa"], out[attention.IMPLEMENTATION])
    with torch.no_grad():  # and the mask matters here: without it the scores differ
        unmasked, _, _ = model_scores(model, {**inputs, "attention_mask": None}, targets, flat_index(at), 0.7, 16)
    assert not torch.allclose(unmasked[at], out["sdpa"][at], atol=1e-4)


def test_varlen_gradients_equal_the_dense_path(model):
    for name, mb in layouts().items():
        _, _, ref = scores(model, mb, "sdpa", grad=True)
        _, _, got = scores(model, mb, "varlen", grad=True)
        assert ref.keys() == got.keys()
        total = sum(float(g.norm() ** 2) for g in ref.values()) ** 0.5
        for n, g in ref.items():
            assert float((got[n] - g).norm()) <= 1e-4 * max(float(g.norm()), 1e-6 * total), f"{name} {n}"


@pytest.mark.parametrize("share_prompt", [False, True], ids=["unshared", "shared"])
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_a_learner_step_with_varlen_equals_the_sdpa_step(model_dir, share_prompt, packing):
    gs = episode_groups(21)
    common = {"algorithm": AlgorithmConfig(name="grpo", objective="decoupled"), "packing": packing,
              "share_prompt": share_prompt, "micro_batch_tokens": 40, "temperature": 0.7}
    sdpa = spied_step(make_rank(model_dir, attention="sdpa", **common), gs)
    varlen_rank = make_rank(model_dir, attention="varlen", **common)
    varlen = spied_step(varlen_rank, gs)
    assert varlen_rank.backend.model.config._attn_implementation == attention.IMPLEMENTATION
    assert_equal_steps(sdpa, varlen)


def test_the_kernels_take_a_query_group_of_any_size():
    """attention_forward itself, 6 query heads on 2 KV heads (a group of 3, as Qwen2.5-0.5B's 7): each
    kernel equals SDPA with the dense mask."""
    mb = layouts()["shared_packed"]
    seg = mb.segments
    b, t = seg.rows, seg.width
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, t, 16, generator=g) for h in (6, 2, 2))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(seg), enable_gqa=True)
    for kernel in ("varlen", "flex"):
        out, _ = attention.attention_forward(None, q, k, v, None, scaling=None,
                                             **{attention.LAYOUT_KWARG: attention.layout_for(seg, kernel)})
        torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-5, rtol=0, msg=kernel)


# ---------------------------------------------------------------- choice and guards


def test_auto_is_varlen_on_cuda_in_bf16_and_sdpa_elsewhere():
    assert resolve("auto", "cpu", half=False) == resolve("auto", "cpu", half=True) == KernelChoice("sdpa", "sdpa")
    assert resolve("auto", "cuda", half=True) == KernelChoice("varlen", "varlen")
    assert resolve("auto", "cuda", half=False) == KernelChoice("sdpa", "sdpa")  # flash takes no fp32
    assert resolve("varlen", "cuda", half=True) == KernelChoice("varlen", "varlen")
    assert not resolve("auto", "cpu", half=False).uses_registry and resolve("auto", "cuda", half=True).uses_registry
    with pytest.raises(ValueError, match="bf16/fp16 only"):
        resolve("varlen", "cuda", half=False)


def test_flex_training_on_cpu_is_refused_with_one_line(model_dir):
    with pytest.raises(RunError, match=r"learner.attention=flex: FlexAttention has no backward on CPU"):
        make_rank(model_dir, attention="flex")


def _fake_varlen(signature: str, calls: list):
    """A stand-in for torch's varlen_attn with one release's keyword arguments; records its calls."""
    namespace: dict = {}
    exec(f"def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, {signature}):\n"
         "    calls.append((key.shape, dict(locals())))\n    return query", {"calls": calls}, namespace)
    return namespace["varlen_attn"]


@pytest.mark.parametrize("signature,gqa", [
    ("return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False", True),  # torch 2.13
    ("is_causal=False, return_aux=None, scale=None", False),  # an older release without GQA
])
def test_the_varlen_call_follows_the_installed_signature(monkeypatch, signature, gqa):
    import torch.nn.attention.varlen as varlen_module

    calls: list = []
    monkeypatch.setattr(varlen_module, "varlen_attn", _fake_varlen(signature, calls))
    attention._varlen_call.cache_clear()
    try:
        q, kv = torch.zeros(10, 4, 8), torch.zeros(10, 2, 8)
        cu = torch.tensor([0, 4, 10], dtype=torch.int32)
        attention._varlen_call()(q, kv, kv, cu, cu, 6, 6, 0.5)
    finally:
        attention._varlen_call.cache_clear()
    key_shape, args = calls[0]
    if gqa:
        assert args["window_size"] == (-1, 0) and args["enable_gqa"] is True and key_shape[1] == 2
    else:
        assert args["is_causal"] is True and key_shape[1] == 4  # K/V heads repeated for the kernel
    assert args["scale"] == 0.5
