"""One gloo rank of a Megatron model-parallel group on CPU (spawned by test_megatron_parallel.py).

Each rank builds the same HF model, loads its TP shard of its pipeline stage into a MegatronPolicy
with megatron's own optimizer (fp32, CPU patches of learner/megatron/cpu.py), and writes what it measured to
`out_dir/rank{R}.pt`: the log-probs of a fixed batch before and after one training step (last stage),
and the full weights gathered under HF names before and after the step (rank 0).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


def hf_model(kind: str) -> torch.nn.Module:
    if kind == "tiny-qwen2":
        from tests.unit._megatron_models import tiny_qwen2

        return tiny_qwen2().float().eval()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(kind, dtype=torch.float32).eval()


def run_rank(rank: int, world: int, port: int, kind: str, tp: int, pp: int, out_dir: str) -> None:
    from megatron.core import parallel_state

    from async_rl.learner.megatron import convert as mcv
    from async_rl.learner.megatron import cpu as megatron_cpu
    from async_rl.learner.megatron.learner import MegatronPolicy, megatron_optimizer
    from tests.unit._megatron_models import fixed_batch

    torch.set_num_threads(1)
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    megatron_cpu.enable()
    try:
        hf = hf_model(kind)
        arch = mcv.arch_from_hf_config(hf.config)
        lr = 1e-3
        policy = MegatronPolicy(
            arch,
            dict(hf.named_parameters()),
            dtype=torch.float32,
            lr=lr,
            weight_decay=0.0,
            max_grad_norm=1.0,
            distributed_optimizer=False,
            te_spec=False,
            cpu_init=True,
            make_optimizer=lambda ddp: megatron_optimizer(ddp, torch.float32, lr, 0.0, 1.0, False),
        )
        b = fixed_batch(min(arch.vocab_size, 1000))
        before = policy.logprobs(b.input_ids)
        gathered_before = _copy(policy.hf_state_dict())  # replicated tensors are the live parameters
        if parallel_state.is_pipeline_last_stage():
            b.behav_logp = before.detach() * b.loss_mask  # on-policy
        stats, grad_norm = policy.train_batch(b, 2, 1.0, 0.2, 0.2, 2.0)
        after = policy.logprobs(b.input_ids)
        gathered_after = _copy(policy.hf_state_dict())
        result = {
            "input_ids": b.input_ids,
            "loss_mask": b.loss_mask,
            "logp_before": before,
            "logp_after": after,
            "grad_norm": grad_norm,
            "loss": None if stats is None else stats.loss,
            "hf_before": gathered_before,
            "hf_after": gathered_after,
        }
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


class ThdCoreAttention(torch.nn.Module):
    """A CPU stand-in for Transformer Engine's attention in megatron's packed (THD) format: causal
    attention within each sequence that `cu_seqlens_q` delimits (what TE computes for
    `attn_mask_type=padding_causal`); without packed-sequence params, the wrapped local attention.
    It lets the CPU tests run the backend's THD branch and megatron's per-sequence RoPE; TE itself
    is checked in tests/gpu/test_megatron_gpu.py."""

    def __init__(self, local: torch.nn.Module) -> None:
        super().__init__()
        self.local = local

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None:
            return self.local(query, key, value, attention_mask, attn_mask_type=attn_mask_type, attention_bias=attention_bias)
        assert packed_seq_params.qkv_format == "thd" and attention_mask is None
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        repeat = query.shape[1] // key.shape[1]  # grouped-query attention
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        out = []
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            q, k, v = (x[a:b].transpose(0, 1) for x in (query, key, value))  # [heads, len, dim]
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.local.softmax_scale)
            out.append(o.transpose(0, 1))
        return torch.cat(out).reshape(query.shape[0], -1)


@contextlib.contextmanager
def thd_attention(backend):
    """`backend` gives packed micro-batches to its model as THD, with `ThdCoreAttention` in every
    layer, for the `with` block."""
    layers = list(backend.policy.model.module.decoder.layers)
    saved = [layer.self_attention.core_attention for layer in layers]
    for layer, local in zip(layers, saved, strict=True):
        layer.self_attention.core_attention = ThdCoreAttention(local)
    backend.packed_as = "thd"
    try:
        yield
    finally:
        backend.packed_as = "mask"
        for layer, local in zip(layers, saved, strict=True):
            layer.self_attention.core_attention = local


class Matmuls(TorchDispatchMode):
    """Counts the matrix products (aten.mm) run while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket is torch.ops.aten.mm
        return func(*args, **(kwargs or {}))


def _copy(weights: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    return None if weights is None else {n: t.detach().clone() for n, t in weights.items()}


def _live_state(backend) -> dict[str, torch.Tensor]:
    """This rank's parameters and every tensor of its optimizer's state, copied."""
    out = {f"param.{n}": p.detach().clone() for n, p in backend.policy.model.named_parameters()}
    opt = backend.policy.optimizer
    for i, o in enumerate(getattr(opt, "chained_optimizers", [opt])):
        for j, state in enumerate(o.optimizer.state.values()):
            out.update({f"opt{i}.{j}.{k}": v.detach().clone() for k, v in state.items() if isinstance(v, torch.Tensor)})
    return out


def seq_samples(vocab: int, seed: int = 7) -> list:
    """Six sequences of different lengths (prompt + completion) with random tokens."""
    import numpy as np

    from async_rl.learner.batch.packing import SeqSample

    rng = np.random.default_rng(seed)
    out = []
    for prompt, completion in [(4, 3), (5, 6), (3, 2), (6, 5), (4, 4), (2, 7)]:
        n = prompt + completion
        out.append(
            SeqSample(
                tokens=rng.integers(3, vocab, size=n).astype(np.int64),
                start=prompt,
                behav_logp=np.zeros(completion, dtype=np.float32),
                advantages=np.ones(completion, dtype=np.float32),
            )
        )
    return out


def critic_step(hidden: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """ppo's value head after one update on `hidden` (fixed returns), as the driver runs it on every
    learner rank: its gradients all-reduced over the whole process group when there is one."""
    from async_rl.learner.rl.critic import Critic

    critic = Critic(hidden.shape[-1], 16, 1e-2, seed=3, max_grad_norm=1e9)
    returns = torch.linspace(-1.0, 1.0, hidden.shape[1]).expand(hidden.shape[:2])
    critic.update(hidden, returns, mask)
    return {n: t.detach().cpu().clone() for n, t in critic.head.state_dict().items()}


def run_backend_rank(rank: int, world: int, port: int, model_dir: str, tp: int, pp: int, out_dir: str) -> None:
    """MegatronBackend on one rank: scores of packed and padded micro-batches, one step of the loss
    -sum(logp)/tokens over two micro-batches (gradient norm before clipping), HF weights before and
    after, and a save/load round trip."""
    from async_rl.learner.batch import packing
    from async_rl.learner.megatron.backend import MegatronBackend

    torch.set_num_threads(1)
    backend = MegatronBackend(
        rank=rank, world_size=world, master=f"127.0.0.1:{port}", tensor_parallel_size=tp, pipeline_parallel_size=pp,
        dtype="float32", lr=1e-3, weight_decay=0.0, max_grad_norm=1.0, distributed_optimizer=True,
        transformer_engine="auto", device="cpu", seed=0,
    )
    try:
        backend.setup(model_dir)
        samples = seq_samples(min(backend.arch.vocab_size, 1000))
        mbs = {"packed": packing.packed(samples, row_tokens=16), "padded": packing.padded(samples)}
        with thd_attention(backend):  # the TE branch's packed (THD) inputs, on CPU
            thd_scores = backend.score(mbs["packed"], 1.0, hidden=True)
        scores = {k: backend.score(mb, 1.0) for k, mb in mbs.items()}
        packed_hidden = backend.score(mbs["packed"], 1.0, hidden=True).hidden
        hidden = backend.score(mbs["padded"], 1.0, hidden=True).hidden  # ppo's critic reads these
        headless = backend.score(mbs["padded"], 1.0, hidden=True, head=False)  # what the driver asks then
        critic_head = critic_step(hidden.to(backend.device), mbs["padded"].attention_mask.float())
        backend.gather_weights()
        before = _copy(backend.hf_weights()) if rank == 0 else None  # valid until the next step: copy
        halves = packing.micro_batches(samples, pack=True, max_seqs=3, row_tokens=16)
        tokens = sum(mb.loss_tokens for mb in halves)

        def loss_fn(i, s):
            return -(s.logp * halves[i].loss_mask.to(s.logp.device)).sum() / tokens

        # The chunked head (3 positions a chunk) against the full vocab-parallel head (chunk 0):
        # scores at temperature 0.7, the training pass's scores (log-probs and the logged entropy,
        # on output ranks) and this rank's gradients of the same loss, before any step.
        # "kept": the chunked head keeping its logits for the backward (learner.logprob_keep_logits).
        head_cmp = {}
        default_chunk = backend.chunk
        for chunk in (0, 3, "kept"):
            backend.chunk, backend.keeps_logits = (3, True) if chunk == "kept" else (chunk, False)
            scored = backend.score(mbs["padded"], 0.7)
            trained = []

            def recording_loss_fn(i, s, trained=trained):
                trained.append((s.logp.detach().cpu(), s.entropy.detach().cpu()))
                return loss_fn(i, s)

            with Matmuls() as matmuls:
                backend.forward_backward(halves, 0.7, recording_loss_fn)
            grads = [p.main_grad.detach().clone() for p in backend.policy.model.parameters()]
            backend.policy.model.zero_grad_buffer()
            head_cmp[chunk] = (scored, grads, trained, matmuls.count)
        backend.chunk, backend.keeps_logits = default_chunk, False
        backend.forward_backward(halves, 1.0, loss_fn)
        grad_norm = backend.optimizer_step(1e-3, 1e9)
        backend.gather_weights()
        after = _copy(backend.hf_weights()) if rank == 0 else None
        # A NaN in rank 1's gradient only: every rank skips the step (the flag is all-reduced).
        nan_step = {"before": _live_state(backend)}
        backend.forward_backward(halves, 1.0, loss_fn)
        if rank == 1:
            backend.policy.model.buffers[0].grad_data.view(-1)[0] = float("nan")
        nan_step["norm"] = backend.optimizer_step(1e-3, 1e9)
        nan_step["after"] = _live_state(backend)
        backend.gather_weights()
        nan_step["hf_after"] = _copy(backend.hf_weights()) if rank == 0 else None

        # The entropy's gradient (algorithm.entropy_coef) through the vocab-parallel entropy, with the
        # chunked and the full head: its norm, from a step at lr 0 (the weights stay as they are).
        def entropy_loss_fn(i, s):
            return -(s.entropy * halves[i].loss_mask.to(s.entropy.device)).sum() / tokens

        entropy_grad_norm = {}
        for chunk in (0, 3):
            backend.chunk = chunk
            backend.forward_backward(halves, 1.0, entropy_loss_fn)
            entropy_grad_norm[chunk] = backend.optimizer_step(0.0, 1e9)
        backend.chunk = default_chunk
        ckpt = Path(out_dir) / "ckpt"
        if rank == 0:
            ckpt.mkdir()
        dist.barrier()
        backend.save(str(ckpt))
        backend.load(str(ckpt))
        backend.gather_weights()
        reloaded = backend.hf_weights() if rank == 0 else None
        torch.save(
            {
                "info": backend.info,
                "mbs": mbs,
                "scores": scores,
                "thd_scores": thd_scores,
                "packed_hidden": packed_hidden,
                "hidden": hidden,
                "headless": headless,
                "critic_head": critic_head,
                "halves": halves,
                "head_cmp": head_cmp,
                "grad_norm": grad_norm,
                "nan_step": nan_step,
                "entropy_grad_norm": entropy_grad_norm,
                "before": before,
                "after": after,
                "reloaded": reloaded,
            },
            Path(out_dir) / f"backend{rank}.pt",
        )
    finally:
        backend.shutdown()
