"""Log-probs and entropies from an HF causal LM's final hidden states, at chosen positions only, a
chunk of positions at a time.

The full head (logits at every position, an fp32 log-softmax, then a slice) builds several fp32
[tokens x vocabulary] tensors that live through backward: 1 GB per 5k tokens with a 49k vocabulary,
most of it at prompt and padding positions that carry no loss. Here the output layer is applied to
the loss positions' hidden states only, `chunk` positions at a time, and `ChunkedHead` recomputes a
chunk's logits in backward instead of saving them (the idea of Liger-Kernel's fused linear
cross-entropy, with the loss left to the caller: it returns log p(target), not a loss), so no
[positions x vocabulary] tensor larger than one chunk exists in forward or backward.

A tied output embedding (SmolLM2, Qwen2.5-0.5B) is the input embedding's parameter: its gradient
from the head and from the embedding lookup add up in autograd as they do for the full head.
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from async_rl.learner.model import head_fused
from async_rl.learner.model.vision_embed import DEEPSTACK_KEYS, trunk, with_image_embeds

# What the no-grad scoring passes and training use when `learner.logprob_chunk_tokens` is not set
# (kept equal to the config default).
DEFAULT_CHUNK = 1024


def keeps_logits(setting: bool | str, device_type: str) -> bool:
    """`learner.logprob_keep_logits` on this device: true, false, or auto (on CUDA, where the GEMM it saves
    is worth the memory; on the CPU, memory is the host's and the tests' dense paths stay as they were)."""
    return setting is True or (setting == "auto" and device_type == "cuda")


def _scaled(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 logits/temperature from one chunk's compute-dtype logits `z` (the eager loops' copy)."""
    z = z.float()
    return z / temperature if temperature != 1.0 else z


def _logits(h: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One chunk's logits in the compute dtype, the matmul there (as the HF head under autocast would
    run it). `weight` is already in `dtype` (cast once per call, not per chunk)."""
    return h.to(dtype) @ weight.t()


# Whether torch's fp32-output GEMM for bf16/fp16 operands (`addmm(..., out_dtype=)`, CUDA only) works
# here: None until first tried, False once it raised (a torch build or GPU without it).
_fp32_out_gemm: bool | None = None


def _accumulate_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b inside the matmul (the GEMM's beta = 1): no [V x H] product tensor per
    chunk and no cast of it. bf16/fp16 operands on CUDA use the fp32-output GEMM (`out_dtype`);
    elsewhere, or where it is missing, the low-precision product is added (CPU autocast, tests)."""
    global _fp32_out_gemm
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if acc.is_cuda and _fp32_out_gemm is not False:
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            _fp32_out_gemm = True
            return
        except (RuntimeError, TypeError, NotImplementedError):
            if _fp32_out_gemm:  # it worked before: a real error
                raise
            _fp32_out_gemm = False
    acc.add_(a @ b)


class ChunkedHead(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N]) -> (log p(targets) [N], entropy [N] or None), fp32,
    at `temperature`. Both differentiable w.r.t. hidden and weight; an output the loss does not use
    costs nothing in backward (its gradient arrives as None). `with_entropy` False (the no-grad scoring
    passes: nothing reads it) skips the entropy altogether.

    Per chunk the forward makes one pass of exponentials over the [chunk x V] logits (log-sum-exp and
    entropy from the same exp(z - max)); the backward one more (softmax from the saved log-sum-exp).
    The weight is cast to the compute dtype once per call, and its fp32 gradient is accumulated
    inside the matmul (`_accumulate_matmul`). `fused` (learner.head_kernel compiled, CUDA by default):
    the same arithmetic per chunk as `head_fused`'s compiled functions of the compute-dtype logits, with
    no fp32 copy of them ("triton": the forward statistics from `head_triton`'s kernel, the backward
    compiled; `head_fused.fused_setting`); the loop below is the eager form, kept for the CPU.

    `keep_logits` (learner.logprob_keep_logits): each chunk's compute-dtype logits are kept from the
    forward for the backward, which then runs two GEMMs a chunk instead of three (no recomputed
    logits), for [N x V] compute-dtype numbers held until the backward. The caller passes it only where
    a gradient will be asked for (`head_scores`: grad mode on at the call; inside `forward` it is always
    off): a no-grad scoring pass holding every chunk would only raise its peak."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int, with_entropy: bool = True,
                fused: head_fused.FusedPath = False, keep_logits: bool = False):
        device_type = hidden.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
        w = weight.to(dtype)
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp) if with_entropy else None
        lse = torch.empty_like(logp)
        stats = head_fused.kernels(fused).stats if fused else None
        keep = keep_logits and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        kept = []  # one tensor a chunk (not views of one: the compiled functions copy views, `_one_compile`)
        for s in range(0, n, chunk):
            product = _logits(hidden[s : s + chunk], w, dtype)
            if keep:
                kept.append(product)
            if stats is not None:  # the compiled arithmetic reads the compute-dtype logits (head_fused)
                logp[s : s + chunk], lse[s : s + chunk], ent = stats(product, targets[s : s + chunk], temperature,
                                                                     with_entropy)
                if entropy is not None:
                    entropy[s : s + chunk] = ent
                continue
            z = _scaled(product, temperature)
            del product  # kept or not, the loop reads the fp32 copy
            if with_entropy:
                top = z.amax(dim=-1, keepdim=True)
                e = torch.exp(z - top)  # the chunk's one exponent pass
                total = e.sum(-1)
                m = top.squeeze(-1) + torch.log(total)
                # H = lse - E_p[z], E_p[z] = sum(e * z) / sum(e)
                entropy[s : s + chunk] = m - (e.mul_(z)).sum(-1) / total
            else:
                m = torch.logsumexp(z, dim=-1)
            lse[s : s + chunk] = m
            logp[s : s + chunk] = z.gather(-1, targets[s : s + chunk, None]).squeeze(-1) - m
        ctx.save_for_backward(hidden, weight, targets, lse, entropy, *kept)
        ctx.temperature, ctx.chunk, ctx.dtype, ctx.fused = temperature, chunk, dtype, fused
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy, *kept = ctx.saved_tensors
        t, chunk, dtype = ctx.temperature, ctx.chunk, ctx.dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None, None, None
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        w = weight.to(dtype)
        grad_of_chunk = head_fused.kernels(ctx.fused).grad if ctx.fused else None
        for i, s in enumerate(range(0, hidden.shape[0], chunk)):
            h = hidden[s : s + chunk].to(dtype)
            z = kept[i] if kept else h @ w.t()  # the chunk's compute-dtype logits
            part = slice(s, s + chunk)
            rest = (
                None if grad_entropy is None else entropy[part], targets[part],
                None if grad_logp is None else grad_logp[part],
                None if grad_entropy is None else grad_entropy[part], t, dtype,
            )  # fmt: skip
            if grad_of_chunk is not None:
                dz = grad_of_chunk(z, lse[part], *rest)
            else:  # in place, one or two fp32 [chunk x V] tensors
                zf = head_fused.scaled_logits_(z, t, bool(kept))
                dz = head_fused.eager_chunk_grad_(zf.sub_(lse[part, None]), *rest)
                del zf
            del z
            if need_h:
                grad_h[s : s + chunk] = (dz @ w).to(hidden.dtype)
            if need_w:
                _accumulate_matmul(grad_w, dz.t(), h)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None, None


def head_scores(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    index: torch.Tensor,
    temperature: float,
    chunk: int,
    entropy: bool = True,
    fused: head_fused.FusedPath = False,
    keep_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) and entropy [B, T] (fp32; the entropy None unless `entropy`) from hidden states
    [B, T, H] and the output weight [V, H], computed at the flat positions `index` (long [N], row * T +
    column; `flat_index` of a bool mask) only: 0 elsewhere. The caller builds the index on the host
    (`MicroBatch.loss_index`), so the gather has no data-dependent shape and no host sync. `fused`: each
    chunk's softmax arithmetic runs compiled (`head_fused`, `learner.head_kernel`; "triton": its forward
    statistics in `head_triton`'s kernel); `keep_logits`: the chunks' logits kept for the backward
    (`ChunkedHead`)."""
    b, t, h = hidden.shape
    flat_h = hidden.reshape(b * t, h).index_select(0, index)
    flat_t = targets.reshape(-1).index_select(0, index)
    logp, ent = ChunkedHead.apply(flat_h, weight, flat_t, float(temperature), max(1, int(chunk)), entropy, fused,
                                  keep_logits and torch.is_grad_enabled())
    zeros = torch.zeros(b * t, dtype=torch.float32, device=hidden.device)
    ent = zeros.index_copy(0, index, ent).reshape(b, t) if ent is not None else None
    return zeros.index_copy(0, index, logp).reshape(b, t), ent


def flat_index(positions: torch.Tensor) -> torch.Tensor:
    """long [N]: the flat indices of the True entries of a bool [B, T] mask (a `nonzero`: one host
    sync where the mask lives on a GPU)."""
    return positions.reshape(-1).nonzero().squeeze(-1)


def full_token_scores(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The full head's path: log p(targets) and the entropy, float32 [B, T], from logits at every
    position, both with their gradient (the entropy's costs one more [B, T, V] tensor kept for backward
    when gradients are on)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def unsupported(model: torch.nn.Module) -> str | None:
    """Why the chunked head cannot reproduce this model's logits (None when it can): it is a plain
    linear map of the final hidden states without bias, scaling or soft-capping."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return f"its output layer is a {type(head).__name__}, not a Linear"
    if head.bias is not None:
        return "its output layer has a bias"
    cfg = model.config
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale"):
        if getattr(cfg, name, None) not in (None, 1, 1.0):
            return f"its config sets {name}"
    return None


def model_scores(
    model: torch.nn.Module,
    inputs: dict,
    targets: torch.Tensor,
    index: torch.Tensor,
    temperature: float,
    chunk: int,
    *,
    hidden: bool = False,
    head: bool = True,
    entropy: bool = True,
    fused: head_fused.FusedPath = False,
    keep_logits: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(logp, entropy, last hidden states) of an HF causal LM on `inputs` (its forward's keyword
    arguments). `chunk` > 0: the trunk, then the chunked head at the flat positions `index` only
    (long [N], `head_scores`; 0 elsewhere);
    `head=False` skips the output layer (logp and entropy None); `entropy=False` skips the entropy
    (None) where the chunked head runs; `fused`: its per-chunk arithmetic compiled (`head_fused`);
    `keep_logits`: its chunks' logits kept for the backward (`ChunkedHead`).
    `chunk` 0: the full head at every position (the former path, kept for comparison).
    Images in `inputs` (a vision-language micro-batch) are embedded first (`vision_embed`)."""
    inputs = with_image_embeds(model, inputs)
    if chunk <= 0 and DEEPSTACK_KEYS[0] in inputs:  # Qwen3-VL: the language model, then the full head
        last = trunk(model, inputs)(**inputs).last_hidden_state
        logp, entropy = full_token_scores(model.get_output_embeddings()(last), targets, temperature)
        return logp, entropy, last if hidden else None
    if chunk <= 0:
        out = model(**inputs, output_hidden_states=hidden)
        logp, entropy = full_token_scores(out.logits, targets, temperature)
        return logp, entropy, out.hidden_states[-1] if hidden else None
    with record_function("learner.trunk"):  # a profiler's region (benchmarks/learner_gpu.py --profile)
        last = trunk(model, inputs)(**inputs).last_hidden_state  # after the final norm: what the head reads
    if not head:
        return None, None, last
    weight = model.get_output_embeddings().weight
    with record_function("learner.head"):
        logp, ent = head_scores(last, weight, targets, index, temperature, chunk, entropy, fused, keep_logits)
    return logp, ent, last if hidden else None
