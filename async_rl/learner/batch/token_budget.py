"""`learner.micro_batch_tokens: auto`: the micro-batch token budget from the GPU's free memory and the
model's activation cost per token, worked out once at start-up and stated in one line.

The estimate (per token, per decoder layer, the tensors autograd keeps for backward in the compute
dtype): the two RMSNorms' inputs and outputs (4h), q, k, v before and after RoPE (2h + 4 kv), the
attention output (h), the residual sum (h), SwiGLU's gate, up, activation and product (4 I): 8h + 4kv
+ 4I elements; with activation checkpointing one hidden state per layer plus one layer recomputed.
A 2.0 margin covers what the count leaves out (autocast's fp32 copies, allocator fragmentation,
attention's row statistics, the chunked head's gathered hidden states): on the first H100 measurement
the 0.5B Qwen2.5 shape under autocast peaked at 47.2 GiB for 16,384 tokens, ~2.4 MiB per token beyond
weights and optimizer; the count times 2.0 is 2.5 MiB. What the step adds besides activations is set
aside first: fp32 gradients and AdamW's two moments (created at the first step, so not yet allocated
at start-up) and the chunked head's few fp32 [chunk x vocabulary] tensors.

The memory counted on is the GPU's total less a tenth (CUDA contexts, a sleeping vLLM's residue in the
colocated placement, fragmentation) less what this process holds already, not the free memory at
start-up: colocated engines may be starting or waking meanwhile, and they sleep while the learner
trains.

On the CPU `auto` is CPU_BUDGET (the former default): host memory is not the learner's alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from async_rl.models.shape import ModelShape

CPU_BUDGET = 8192
MARGIN = 2.0
RESERVE = 0.1  # of the GPU's total memory, never counted on
GRANULE = 1024  # the budget is a multiple of this
BOUNDS = (1024, 262144)


@dataclass(frozen=True)
class Budget:
    tokens: int
    line: str  # the start-up line that says how it was worked out


def activation_bytes_per_token(shape: ModelShape, compute_bytes: int, checkpointing: bool,
                               margin: float = MARGIN) -> int:
    """Bytes of saved activations per token of a micro-batch (the whole trunk) for a decoder's shape;
    `margin` 1.0: the count alone (what autograd's saved tensors come to, as measured on CPU)."""
    h, layers = shape.hidden_size, shape.num_hidden_layers
    per_layer = 8 * h + 4 * shape.kv_size() + 4 * shape.intermediate_size
    kept = layers * h + per_layer if checkpointing else layers * per_layer
    return int(kept * compute_bytes * margin)


def step_state_bytes(trainable_params: int) -> int:
    """What the first optimizer step adds for good: fp32 gradients and AdamW's exp_avg and exp_avg_sq."""
    return trainable_params * 4 * 3


def head_chunk_bytes(chunk: int, vocab_size: int) -> int:
    """The chunked head's few fp32 [chunk x vocabulary] tensors (0: no chunked head)."""
    return 3 * max(chunk, 1) * vocab_size * 4 if chunk else 0


def kept_logits_bytes_per_token(vocab_size: int, compute_bytes: int, keeps_logits: bool, chunk: int) -> int:
    """`learner.logprob_keep_logits`: each loss position's logits held for the backward."""
    return vocab_size * compute_bytes if keeps_logits and chunk else 0


def resolve_budget(
    setting: int | str,
    *,
    device: torch.device,
    config,
    trainable_params: int,
    compute_bytes: int,
    checkpointing: bool,
    chunk: int,
    keeps_logits: bool = False,
    available_bytes: int | None = None,
    sequence_parallel: int = 1,
) -> Budget:
    """The micro-batch token budget for `learner.micro_batch_tokens` = `setting` (an int is kept as it is).
    `config`: the model's Hugging Face config (read as a `ModelShape`). `available_bytes`: the memory
    the step may use (None: the GPU's total less RESERVE less what this process has reserved).
    `keeps_logits`: the chunked head keeps each loss position's logits for the backward
    (`learner.logprob_keep_logits`), vocabulary x compute bytes more per token (every token counted as a
    loss position: the budget cannot know the completions' share). `sequence_parallel` (SP): a micro-batch's
    tokens are split over SP ranks (`model/ulysses.py`), each holding the activations of its 1 / SP: the
    budget is SP times one rank's (on the CPU too)."""
    if setting != "auto":
        return Budget(int(setting), f"learner.micro_batch_tokens={setting}")
    sp = f" x sequence_parallel_size {sequence_parallel}" if sequence_parallel > 1 else ""
    if device.type != "cuda":
        return Budget(CPU_BUDGET * sequence_parallel,
                      f"learner.micro_batch_tokens=auto: {CPU_BUDGET * sequence_parallel} tokens (the CPU default{sp})")
    if available_bytes is None:
        total = torch.cuda.mem_get_info(device)[1]
        available_bytes = int(total * (1 - RESERVE)) - torch.cuda.memory_reserved(device)
    shape = ModelShape.of(config)
    step_state = step_state_bytes(trainable_params)
    head = head_chunk_bytes(chunk, shape.vocab_size)
    activations = activation_bytes_per_token(shape, compute_bytes, checkpointing)
    logits = kept_logits_bytes_per_token(shape.vocab_size, compute_bytes, keeps_logits, chunk)
    per_token = activations + logits
    room = available_bytes - step_state - head
    tokens = int(min(max(room // per_token // GRANULE * GRANULE, BOUNDS[0]), BOUNDS[1])) * sequence_parallel
    gib = 2**30
    line = (
        f"learner.micro_batch_tokens=auto: {tokens} tokens = (available {available_bytes / gib:.1f} GiB - gradients and "
        f"AdamW {step_state / gib:.1f} GiB - head chunk {head / gib:.1f} GiB) / {per_token / 2**20:.2f} MiB per token "
        f"({activations / 2**20:.2f} MiB of activations: {shape.num_hidden_layers} layers, {compute_bytes}-byte compute"
        f"{', checkpointed' if checkpointing else ''}, x{MARGIN} margin"
        f"{f'; {logits / 2**20:.2f} MiB of kept logits' if logits else ''}), in [{BOUNDS[0]}, {BOUNDS[1]}]{sp}"
    )
    return Budget(tokens, line)
