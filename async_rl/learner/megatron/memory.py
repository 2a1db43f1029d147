"""What one Megatron learner rank holds on its GPU with megatron's local spec (no Transformer Engine),
from the model's shape and the micro-batch's size: the arithmetic behind the start-up line that
states the largest `learner.micro_batch_tokens` that fits.

The local spec's attention (`DotProductAttention`, `attention_softmax_in_fp32`) materialises every
score: per layer it keeps, for backward, the fp32 softmax output (4 bytes a score, softmax's
backward reads it) and the bf16 probabilities (2 bytes, the value matmul's input), for
rows x heads/TP x row_width^2 scores, that is heads/TP x tokens x row_width once the micro-batch's
rows are full. TE's fused attention (and THD packed sequences) keeps a log-sum-exp per query only, and
so do torch's kernels that `learner.megatron.attention` puts in the local spec's place (sdpa,
varlen: `megatron.attention`): 4 bytes per query and head; sdpa on packed rows adds one additive
mask in the model dtype per micro-batch (rows x row_width^2 entries, shared by every layer), counted
as if the micro-batch were packed.

The other saved activations per layer and token, in the model dtype's bytes d (bf16: d = 2), are
counted from the local spec's saved tensors (listed with autograd's saved-tensor hooks on CPU): the
two norms' inputs, normalised inputs and outputs (6 x h, whole on every TP rank without sequence
parallelism), the query, the GQA-repeated keys and values and the attention's context (4 x h / TP),
the MLP's fc1 output (2 x ffn), SwiGLU's activation, its linear half plus megatron's
glu_linear_offset and their product (3 x ffn), all / TP. Full recompute
(`learner.activation_checkpointing`) keeps each layer's input only.

An estimate: allocator fragmentation and the transient buffers of one layer's backward come on top.
The per-layer part is checked against megatron's local spec on CPU in fp32 (tests/unit/
test_megatron_memory.py measures what a forward keeps); on a GPU in bf16 it is unverified.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
# of the GPU's memory the estimate may fill: the rest for allocator fragmentation, one layer's
# backward buffers, cuBLAS workspaces
USABLE = 0.9


@dataclass(frozen=True)
class RankShape:
    """One learner rank's share of the model and of a micro-batch."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    vocab: int
    params: int  # of the whole model
    tp: int = 1
    pp: int = 1
    dp: int = 1
    dtype_bytes: int = 2  # bf16
    distributed_optimizer: bool = True
    recompute: bool = False
    chunk: int = 1024  # learner.logprob_chunk_tokens (0: the full head)
    attention: str = "local"  # learner.megatron.attention as resolved: local, sdpa or varlen
    keep_logits: bool = False  # learner.logprob_keep_logits as resolved: each chunk's logits kept for backward


@dataclass(frozen=True)
class RankMemory:
    weights: int  # parameters, the fp32 gradient buffer, fp32 main weights and Adam's moments
    attention: int  # per layer: the local spec's kept scores, or torch kernels' log-sum-exp
    activations: int  # the other saved activations
    head: int  # the output layer's fp32 [positions x vocab/TP] tensors
    mask: int = 0  # sdpa: the micro-batch's additive mask, shared by every layer

    @property
    def total(self) -> int:
        return self.weights + self.attention + self.activations + self.head + self.mask


def score_bytes(s: RankShape) -> int:
    """Bytes kept per attention score and layer: the fp32 softmax output, and in a 16-bit model the
    probabilities cast back for the value matmul (in fp32 the softmax output is that input)."""
    return 4 + (2 if s.dtype_bytes < 4 else 0)


def attention_score_bytes(s: RankShape, tokens: int, row_tokens: int) -> int:
    """The local spec's kept attention scores: 6 (bf16; fp32: 4) x layers x heads/TP x tokens x row
    width bytes (one layer's with full recompute); torch's kernels keep an fp32 log-sum-exp per query
    and head instead."""
    layers = 1 if s.recompute else s.layers
    if s.attention != "local":
        return 4 * layers * (s.heads // s.tp) * tokens
    return score_bytes(s) * layers * (s.heads // s.tp) * tokens * min(row_tokens, tokens)


def mask_bytes(s: RankShape, tokens: int, row_tokens: int) -> int:
    """sdpa's additive mask of a packed micro-batch: rows x row_width^2 entries in the model dtype."""
    return s.dtype_bytes * tokens * min(row_tokens, tokens) if s.attention == "sdpa" else 0


def weight_bytes(s: RankShape) -> int:
    """Per parameter of this rank: the parameter, its fp32 gradient (megatron's grad_reduce_in_fp32)
    and Adam's two fp32 moments, with fp32 main weights besides a 16-bit parameter; the main weights
    and moments sharded over data-parallel ranks by the distributed optimizer."""
    mine = s.params // (s.tp * s.pp)
    shard = s.dp if s.distributed_optimizer else 1
    state = (8 + (4 if s.dtype_bytes < 4 else 0)) / shard
    return int(mine * (s.dtype_bytes + 4 + state))


def _layer_bytes_per_token(s: RankShape) -> int:
    """One layer's saved activations per token besides the attention scores (module docstring)."""
    return s.dtype_bytes * (6 * s.hidden + (4 * s.hidden + 5 * s.ffn) // s.tp)


def estimate(s: RankShape, tokens: int, row_tokens: int) -> RankMemory:
    """What the rank holds at the peak of a micro-batch of `tokens` tokens in rows of `row_tokens`."""
    if s.recompute:
        per_token = s.layers * s.hidden * s.dtype_bytes  # each layer's input
        per_token += _layer_bytes_per_token(s)  # the layer being recomputed
    else:
        per_token = s.layers * _layer_bytes_per_token(s)
    positions = s.chunk if s.chunk else tokens
    # the chunked head: two fp32 tensors and the matmul's output in the model dtype; the full head:
    # megatron's vocab-parallel cross entropy and the entropy, ~6 fp32 copies over every position
    head = positions * (s.vocab // s.tp) * ((8 + s.dtype_bytes) if s.chunk else 24)
    if s.chunk and s.keep_logits:  # every chunk's logits in the model dtype, every token counted as scored
        head += tokens * (s.vocab // s.tp) * s.dtype_bytes
    return RankMemory(
        weights=weight_bytes(s),
        attention=attention_score_bytes(s, tokens, row_tokens),
        activations=per_token * tokens,
        head=head,
        mask=mask_bytes(s, tokens, row_tokens),
    )


def max_tokens(s: RankShape, capacity: int, row_tokens: int, step: int = 512) -> int:
    """The most micro-batch tokens (a multiple of `step`, 0 if none) whose estimate fits `capacity`
    bytes, rows of at most `row_tokens` tokens."""
    lo, hi = 0, 1 << 24
    while hi - lo > step:  # the estimate grows with tokens: bisect on multiples of `step`
        mid = (lo + hi) // 2 // step * step
        if estimate(s, mid, row_tokens).total <= capacity:
            lo = mid
        else:
            hi = mid
    return lo


def local_spec_line(s: RankShape, tokens: int, row_tokens: int, capacity: int) -> str:
    """The start-up line without Transformer Engine: that packed sequences and fused attention need
    it, what the local spec's attention costs at this size, and the largest micro_batch_tokens whose
    estimate fits `USABLE` of `capacity` bytes (`tokens` 0: the whole shard in one pass)."""
    usable = int(capacity * USABLE)
    fit = max_tokens(s, usable, row_tokens)
    if s.attention != "local":
        m = estimate(s, tokens or row_tokens, row_tokens)
        verdict = "fits" if m.total <= usable else "does NOT fit: lower learner.micro_batch_tokens"
        mask = f", one {m.mask / GIB:.2f} GiB additive mask per packed micro-batch" if m.mask else ""
        return (
            f"[learner] megatron without Transformer Engine: attention through torch's {s.attention} "
            f"(learner.megatron.attention), no [T x T] scores kept (an fp32 log-sum-exp per query{mask}); "
            f"estimated peak {m.total / GIB:.1f} GiB of {capacity / GIB:.1f} GiB at micro_batch_tokens "
            f"{tokens or row_tokens} ({verdict}); micro_batch_tokens <= {fit} fits by the estimate"
        )
    if tokens:
        m = estimate(s, tokens, row_tokens)
        verdict = "fits" if m.total <= usable else "does NOT fit: lower learner.micro_batch_tokens"
        size = (
            f"= {m.attention / GIB:.1f} GiB at micro_batch_tokens {tokens}, rows <= {min(row_tokens, tokens)}; "
            f"estimated peak {m.total / GIB:.1f} GiB of {capacity / GIB:.1f} GiB ({verdict}"
        )
    else:
        size = f"at rows <= {row_tokens}; micro_batch_tokens 0 sends the whole shard at once ({capacity / GIB:.1f} GiB"
    return (
        "[learner] megatron without Transformer Engine: packed sequences (THD) and fused attention need it "
        f"(pip install transformer-engine); the local spec keeps {score_bytes(s)} x layers x heads/TP x tokens x "
        f"row width bytes of attention scores (fp32 softmax{' + bf16 probabilities' if s.dtype_bytes < 4 else ''}) "
        f"{size}; micro_batch_tokens <= {fit} fits by the estimate"
        f"{'' if s.recompute else ', more with learner.activation_checkpointing'})"
    )
