"""The arithmetic of the Megatron backend's start-up line without Transformer Engine
(`learner.megatron.memory`): the local spec's kept attention scores, the weights and optimizer
state, the largest micro-batch the estimate fits, and the line itself."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from async_rl.learner.megatron.memory import (
    GIB,
    USABLE,
    RankShape,
    attention_score_bytes,
    estimate,
    local_spec_line,
    max_tokens,
    weight_bytes,
)

# Qwen2.5-0.5B's shape, bf16, one GPU: the 1-GPU recipe's model
QWEN_05B = RankShape(layers=24, hidden=896, ffn=4864, heads=14, vocab=151936, params=494_032_768)
H100 = 80 * 10**9


def test_attention_scores_are_six_bytes_per_score_per_layer():
    # 24 layers x 14 heads x 16384 tokens x rows of 712: fp32 softmax + bf16 probabilities
    assert attention_score_bytes(QWEN_05B, 16384, 712) == 23_517_462_528
    assert attention_score_bytes(dataclasses.replace(QWEN_05B, tp=2), 16384, 712) == 23_517_462_528 // 2
    assert attention_score_bytes(dataclasses.replace(QWEN_05B, recompute=True), 16384, 712) == 23_517_462_528 // 24
    # a row is never wider than the micro-batch
    assert attention_score_bytes(QWEN_05B, 512, 712) == 6 * 24 * 14 * 512 * 512
    # fp32: the softmax output is the value matmul's input
    assert attention_score_bytes(dataclasses.replace(QWEN_05B, dtype_bytes=4), 512, 712) == 4 * 24 * 14 * 512 * 512


def test_weights_count_the_fp32_main_weights_and_moments_sharded_by_the_distributed_optimizer():
    one = weight_bytes(QWEN_05B)  # bf16 param 2 + fp32 grad 4 + fp32 main 4 + Adam 8
    assert one == 494_032_768 * 18
    assert weight_bytes(dataclasses.replace(QWEN_05B, dp=4)) == 494_032_768 * (6 + 3)
    assert weight_bytes(dataclasses.replace(QWEN_05B, dp=4, distributed_optimizer=False)) == one
    # fp32: the parameters are the main weights
    assert weight_bytes(dataclasses.replace(QWEN_05B, dtype_bytes=4)) == 494_032_768 * 16


def test_the_chunked_head_is_a_fixed_cost_and_the_full_head_grows_with_the_tokens():
    chunked = [estimate(QWEN_05B, t, 712).head for t in (4096, 16384)]
    assert chunked[0] == chunked[1] == 1024 * 151936 * (8 + 2)
    full = dataclasses.replace(QWEN_05B, chunk=0)
    assert estimate(full, 16384, 712).head == 4 * estimate(full, 4096, 712).head


def test_kept_logits_add_every_tokens_logits_in_the_model_dtype():
    """learner.logprob_keep_logits: a 16,384-token micro-batch holds its positions' logits until the
    backward, counted as if every token were scored (vocabulary / TP x 2 bytes a token), and a TP rank
    holds its shard's; the full head (chunk 0) keeps nothing more."""
    kept = dataclasses.replace(QWEN_05B, keep_logits=True)
    extra = estimate(kept, 16384, 712).head - estimate(QWEN_05B, 16384, 712).head
    assert extra == 16384 * 151936 * 2
    tp2 = dataclasses.replace(kept, tp=2)
    assert estimate(tp2, 16384, 712).head - estimate(dataclasses.replace(tp2, keep_logits=False), 16384, 712).head == extra // 2
    full = dataclasses.replace(QWEN_05B, chunk=0)
    assert estimate(dataclasses.replace(full, keep_logits=True), 16384, 712) == estimate(full, 16384, 712)
    assert max_tokens(kept, int(H100 * USABLE), 712) < max_tokens(QWEN_05B, int(H100 * USABLE), 712)


def test_the_recipe_model_at_16384_tokens_fits_an_80_gb_gpu_by_the_estimate():
    m = estimate(QWEN_05B, 16384, 712)
    assert m.attention == attention_score_bytes(QWEN_05B, 16384, 712)
    assert m.total <= H100 * USABLE, m.total / GIB
    limit = max_tokens(QWEN_05B, int(H100 * USABLE), 712)
    assert limit % 512 == 0 and limit >= 16384
    assert estimate(QWEN_05B, limit, 712).total <= H100 * USABLE < estimate(QWEN_05B, limit + 512, 712).total
    # full recompute keeps one layer's scores: far more tokens fit
    assert max_tokens(dataclasses.replace(QWEN_05B, recompute=True), int(H100 * USABLE), 712) > 4 * limit


def test_the_start_up_line_states_the_cost_and_the_limit_in_one_line():
    line = local_spec_line(QWEN_05B, 16384, 712, H100)
    assert "\n" not in line
    assert "packed sequences (THD) and fused attention need it" in line
    assert "6 x layers x heads/TP x tokens x row width bytes of attention scores (fp32 softmax + bf16" in line
    assert f"= {23_517_462_528 / GIB:.1f} GiB at micro_batch_tokens 16384, rows <= 712" in line
    assert "(fits;" in line
    assert f"micro_batch_tokens <= {max_tokens(QWEN_05B, int(H100 * USABLE), 712)} fits" in line
    too_big = local_spec_line(QWEN_05B, 65536, 712, H100)
    assert "does NOT fit: lower learner.micro_batch_tokens" in too_big
    assert "the whole shard at once" in local_spec_line(QWEN_05B, 0, 712, H100)


def test_torch_attention_keeps_no_scores_and_states_so_at_start_up():
    sdpa = dataclasses.replace(QWEN_05B, attention="sdpa")
    m = estimate(sdpa, 16384, 712)
    assert m.attention == 4 * 24 * 14 * 16384  # a log-sum-exp per query, head and layer
    assert m.mask == 2 * 16384 * 712  # one additive bf16 mask, shared by the layers
    assert estimate(dataclasses.replace(sdpa, attention="varlen"), 16384, 712).mask == 0
    # the scores were about half of the estimate at the local spec's limit (19968 tokens; sdpa: 38400)
    assert max_tokens(sdpa, int(H100 * USABLE), 712) > 1.5 * max_tokens(QWEN_05B, int(H100 * USABLE), 712)
    line = local_spec_line(sdpa, 16384, 712, H100)
    assert "\n" not in line and "attention through torch's sdpa" in line and "(fits)" in line


@pytest.mark.parametrize("kernel", ["local", "sdpa"])
def test_the_per_layer_estimate_is_what_megatrons_local_spec_keeps_on_cpu(kernel):
    """A forward of megatron's local spec (fp32, CPU) keeps, per token and layer, what the estimate
    counts (attention scores and the other saved activations), within 5%: measured as the net
    allocation of a second forward (torch.profiler's allocator events), two depths apart so the
    embedding and the output cancel out."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from torch.profiler import ProfilerActivity, profile

    from async_rl.learner.megatron import cpu as megatron_cpu
    from async_rl.learner.megatron import model as mm
    from async_rl.learner.megatron.convert import HFArch
    from tests.unit._megatron_models import one_rank_model_parallel

    rows, width = 4, 256

    def kept_by_forward(layers: int) -> int:
        arch = HFArch(
            model_type="qwen2", num_layers=layers, hidden_size=256, ffn_hidden_size=704, num_heads=8,
            num_kv_heads=2, head_dim=32, vocab_size=512, tie_embeddings=True, qkv_bias=True, rms_eps=1e-6,
            rope_theta=1e4, rope_scaling_factor=0, max_position_embeddings=1024,
        )
        model = mm.build_model(arch, torch.float32, cpu_init=True, te_spec=False, attention=kernel)
        ids = torch.randint(0, 512, (rows, width), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(width)[None].expand(rows, -1)
        mask = torch.triu(torch.ones(width, width, dtype=torch.bool), 1)[None, None]
        if kernel == "sdpa":  # the backend's form: additive, built once per micro-batch
            mask = torch.zeros(mask.shape).masked_fill_(mask, float("-inf"))
        model(ids, positions, mask)  # megatron's global score buffer is allocated once, here (result dropped)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = model(ids, positions, mask)
        assert out.requires_grad
        return sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")

    with one_rank_model_parallel(), megatron_cpu.patched():
        per_layer = (kept_by_forward(4) - kept_by_forward(2)) / 2
    shape = RankShape(layers=1, hidden=256, ffn=704, heads=8, vocab=512, params=0, dtype_bytes=4, attention=kernel)
    want = estimate(shape, rows * width, width)
    assert abs(per_layer - (want.attention + want.activations)) < 0.05 * per_layer, (per_layer, want)
