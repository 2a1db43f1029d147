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


def run_attention_rank(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    from async_rl.learner import packing
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

                def loss_fn(i, s, mbs=mbs, tokens=tokens):
                    return -(s.logp * mbs[i].loss_mask.to(s.logp.device)).sum() / tokens

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
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        backend.shutdown()
