"""One gloo rank of test_megatron_attention.py: the same MegatronBackend (TP=2, fp32, CPU) scored
and differentiated with each core attention swapped into its layers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from tests.unit._host_reads import HostReads
from tests.unit._megatron_ranks import seq_samples

KERNELS = ["local", "sdpa", "varlen"]


def core_attention_names(config, kernel: str) -> set[str]:
    """The class names of the core attention the local decoder spec builds for `kernel`."""
    from async_rl.learner.megatron.model import decoder_spec

    spec = decoder_spec(config, te_spec=False, attention=kernel)
    return {s.submodules.self_attention.submodules.core_attention.__name__ for s in spec.layer_specs}


def _swap(backend, kernel: str, saved: list) -> None:
    from async_rl.learner.megatron.attention import core_attention_class

    layers = list(backend.policy.model.module.decoder.layers)
    for layer, local in zip(layers, saved, strict=True):
        if kernel == "local":
            layer.self_attention.core_attention = local
        else:
            layer.self_attention.core_attention = core_attention_class()(
                config=local.config, layer_number=local.layer_number, attn_mask_type=local.attn_mask_type,
                attention_type="self",
            )
    backend.attention = kernel
    backend.packed_as = "row" if kernel == "varlen" else "mask"


def mean_logp_loss(mbs: list, tokens: int):
    """The loss over `mbs`: minus the log-probs of their loss tokens, over `tokens` (all of them)."""

    def loss_fn(i, s):
        return -(s.logp * mbs[i].loss_mask.to(s.logp.device)).sum() / tokens

    return loss_fn


@contextlib.contextmanager
def counting_thd_rope(calls: list) -> Iterator[None]:
    """Appends one entry to `calls` per call of megatron's per-sequence RoPE for THD inputs (without
    Transformer Engine: a host read of the lengths and one rotation per sequence) in the block."""
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils._apply_rotary_pos_emb_thd

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    rope_utils._apply_rotary_pos_emb_thd = counted
    try:
        yield
    finally:
        rope_utils._apply_rotary_pos_emb_thd = original


def shared_prompt_samples(vocab: int, seed: int = 11) -> list:
    """Two groups of three samples, each group one prompt (5 and 3 tokens) with its own completions."""
    import numpy as np

    from async_rl.learner.batch.packing import SeqSample

    rng = np.random.default_rng(seed)
    out = []
    for prompt_len, completions in [(5, (4, 2, 6)), (3, (3, 5, 1))]:
        prompt = rng.integers(3, vocab, size=prompt_len)
        for n in completions:
            out.append(SeqSample(
                tokens=np.concatenate([prompt, rng.integers(3, vocab, size=n)]).astype(np.int64), start=prompt_len,
                behav_logp=np.zeros(n, dtype=np.float32), advantages=np.ones(n, dtype=np.float32),
            ))
    return out


def shared_prompt_results(backend, saved: list) -> dict:
    """With the varlen kernel: the same samples unshared (each carries its prompt) and with one prompt
    per group (`learner.share_prompt`, the row's key index and per-token RoPE): each layout's
    per-sequence log-probs and every parameter's gradient of the loss over all their tokens, and
    whether the backend takes shared micro-batches with each kernel."""
    from async_rl.learner.batch import packing
    from async_rl.learner.batch.shared_prefix import shared_micro_batches

    out: dict = {"takes": {}}
    for kernel in ("sdpa", "varlen"):
        _swap(backend, kernel, saved)
        out["takes"][kernel] = backend.takes_block_masks
    samples = shared_prompt_samples(min(backend.arch.vocab_size, 1000))
    for name, build in (("unshared", packing.micro_batches), ("shared", shared_micro_batches)):
        mbs = build(samples, True, 0, 0, 24)  # one micro-batch: the sequences in sample order
        assert len(mbs) == 1
        tokens = sum(mb.loss_tokens for mb in mbs)
        backend.forward_backward(mbs, 0.8, mean_logp_loss(mbs, tokens))
        grads = [p.main_grad.detach().clone() for p in backend.policy.model.parameters()]
        backend.policy.model.zero_grad_buffer()
        out[name] = {
            "logp": mbs[0].per_sequence(backend.score(mbs[0], 0.8).logp), "grads": grads,
            "tokens": mbs[0].input_ids.numel(), "shares": mbs[0].segments.shares_prefixes,
        }
        if name == "shared":  # a rank with fewer micro-batches runs dummies (padded, one token) after them
            padded_out = [*mbs, packing.dummy_micro_batch()]
            backend.forward_backward(padded_out, 0.8, mean_logp_loss(padded_out, tokens))
            out["with_dummy"] = [p.main_grad.detach().clone() for p in backend.policy.model.parameters()]
            backend.policy.model.zero_grad_buffer()
    return out


def run_attention_rank(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    from async_rl.learner.batch import packing
    from async_rl.learner.megatron.backend import MegatronBackend

    torch.set_num_threads(1)
    backend = MegatronBackend(
        rank=rank, world_size=world, master=f"127.0.0.1:{port}", tensor_parallel_size=world, pipeline_parallel_size=1,
        dtype="float32", lr=1e-3, weight_decay=0.0, max_grad_norm=1.0, distributed_optimizer=True,
        transformer_engine="off", device="cpu", seed=0, attention="local",
    )
    try:
        backend.setup(model_dir)
        saved = [layer.self_attention.core_attention for layer in backend.policy.model.module.decoder.layers]
        samples = seq_samples(min(backend.arch.vocab_size, 1000))
        layouts = {
            "packed": packing.micro_batches(samples, pack=True, max_seqs=3, row_tokens=16),
            "padded": packing.micro_batches(samples, pack=False, max_seqs=3, row_tokens=16),
        }
        config = backend.policy.model.module.config
        result: dict = {"loss_mask": {}, "spec": {k: core_attention_names(config, k) for k in KERNELS},
                        "reads": {k: {} for k in KERNELS}, "thd_rope": {k: {} for k in KERNELS}}
        for kernel in KERNELS:
            _swap(backend, kernel, saved)
            result[kernel] = {}
            assert {type(layer.self_attention.core_attention).__name__ for layer in backend.policy.model.module.decoder.layers} == (
                {"DotProductAttention"} if kernel == "local" else {"TorchCoreAttention"}
            )
            for layout, mbs in layouts.items():
                tokens = sum(mb.loss_tokens for mb in mbs)
                loss_fn = mean_logp_loss(mbs, tokens)
                thd_rope: list = []
                with counting_thd_rope(thd_rope):
                    backend.forward_backward(mbs, 0.8, loss_fn)
                result["thd_rope"][kernel][layout] = len(thd_rope)
                grads = [p.main_grad.detach().clone() for p in backend.policy.model.parameters()]
                backend.policy.model.zero_grad_buffer()
                reads = []  # host reads of a forward/backward over one micro-batch, then over all
                for n in (1, len(mbs)):
                    with HostReads().counting() as counted:
                        backend.forward_backward(mbs[:n], 0.8, loss_fn)
                    backend.policy.model.zero_grad_buffer()
                    reads.append((n, counted.count))
                result["reads"][kernel][layout] = reads
                result[kernel][layout] = {"logp": backend.score(mbs[0], 0.8).logp.detach().clone(), "grads": grads}
                result["loss_mask"][layout] = mbs[0].loss_mask
        result["shared"] = shared_prompt_results(backend, saved)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        backend.shutdown()
