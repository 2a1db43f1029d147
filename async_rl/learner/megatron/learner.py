"""Megatron-core policy for one rank: GPTModel (its TP shard of its pipeline stage) under megatron's
DDP with megatron's optimizer, used by `backend.MegatronBackend` (the learner driver's
model backend for `learner.backend: megatron`).

`MegatronPolicy.train_batch` / `logprobs` are the PPO-clip step and the scoring pass on a
`batch.Collated` shard through megatron's schedules: the component and GPU tests drive the
model with them; the run itself goes through the driver and the backend.

megatron-core is imported inside the methods (it is an optional, GPU-side dependency).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import torch

from async_rl.errors import RunError
from async_rl.learner.megatron import model as mm
from async_rl.learner.megatron.batch import Collated
from async_rl.learner.megatron.convert import HFArch
from async_rl.learner.rl.losses import PolicyLossStats as LossStats
from async_rl.learner.rl.losses import policy_loss


class MicroBatch(msgspec.Struct):
    input_ids: torch.Tensor
    behav_logp: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor


def use_transformer_engine(choice: str) -> bool:
    if choice == "on" and not mm.transformer_engine_available():
        raise RunError("learner.megatron.transformer_engine=on but transformer_engine is not importable")
    return choice == "on" or (choice == "auto" and mm.transformer_engine_available())


class MegatronPolicy:
    """One rank's Megatron model, DDP wrapper and optimizer. No Ray, no sockets: `parallel_state`
    must be initialised by the caller; tests drive this class directly."""

    def __init__(
        self,
        arch: HFArch,
        weights: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype,
        lr: float,
        weight_decay: float,
        max_grad_norm: float,
        distributed_optimizer: bool,
        te_spec: bool,
        cpu_init: bool,
        make_optimizer: Callable[[torch.nn.Module], Any] | None = None,
        recompute: bool = False,
        attention: str = "local",
    ) -> None:
        """`attention`: the local spec's core attention, `local` (megatron's) or `sdpa`/`varlen`
        (`megatron.attention`); ignored with TE. `make_optimizer(ddp_model)` replaces megatron's optimizer (whose code allocates on 'cuda'
        unconditionally): the CPU tests pass a stand-in with the same step/zero_grad/scale_loss."""
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        self.arch = arch
        self.te_spec = te_spec
        model = mm.build_model(arch, dtype, cpu_init=cpu_init, te_spec=te_spec, recompute=recompute, attention=attention)
        if distributed_optimizer:
            mm.check_single_dtype(model, dtype)
        if not cpu_init:
            model.cuda(torch.cuda.current_device())
        mm.load_hf_weights(model, weights, arch, te_spec)
        self.config = model.config
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
        )
        self.model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
        make = make_optimizer or (
            lambda ddp: megatron_optimizer(ddp, dtype, lr, weight_decay, max_grad_norm, distributed_optimizer)
        )
        self.optimizer = make(self.model)
        # What megatron's training loop wires up: DP grad reduction (and the tied-embedding
        # all-reduce between first and last stage) after the backward passes, loss scaling.
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.config.no_sync_func = self.model.no_sync

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def train_batch(
        self,
        b: Collated,
        micro_batches: int,
        temperature: float,
        eps_low: float,
        eps_high: float,
        tis_cap: float,
    ) -> tuple[LossStats | None, float]:
        """One optimizer step on the shard `b` (gradients accumulated over `micro_batches`).

        The loss is the token mean over the whole shard, as in the torch backend: each micro-batch's
        token-mean loss is weighted by its share of the shard's tokens (times the count, which the
        schedule divides back out). Returns the loss statistics (None off the last pipeline stage)
        and the global gradient norm before clipping.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        n, width = b.input_ids.shape
        if n % micro_batches:
            raise RunError(f"learner.megatron.micro_batches={micro_batches} does not divide this shard's {n} sequences")
        dev = self.device
        size = n // micro_batches
        chunks = [
            MicroBatch(
                input_ids=b.input_ids[i : i + size].to(dev),
                behav_logp=b.behav_logp[i : i + size].to(dev),
                advantages=b.advantages[i : i + size].to(dev),
                loss_mask=b.loss_mask[i : i + size].to(dev),
            )
            for i in range(0, n, size)
        ]
        total = float(b.loss_mask.sum().clamp(min=1.0))
        seen: list[tuple[LossStats, float]] = []
        vocab = self.arch.vocab_size

        def forward_step(data_iterator, model):
            mb: MicroBatch = next(data_iterator)
            output = mm.forward_logits(model, mb.input_ids)

            def loss_func(logits: torch.Tensor):
                logp = mm.vocab_parallel_logprobs(logits[:, :-1], mb.input_ids[:, 1:], vocab, temperature)
                loss, _, stats = policy_loss(
                    logp, mb.behav_logp, mb.advantages, mb.loss_mask, eps_low=eps_low, eps_high=eps_high, tis_cap=tis_cap
                )
                share = float(mb.loss_mask.sum()) / total
                seen.append((stats, share))
                return loss * (share * micro_batches), {}

            return output, loss_func

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(chunks),
            model=[self.model],
            num_microbatches=micro_batches,
            seq_length=width,
            micro_batch_size=size,
            forward_only=False,
        )
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RunError("megatron optimizer step skipped (inf/nan gradients)")
        stats = _weighted(seen) if seen else None
        return stats, float(grad_norm if grad_norm is not None else 0.0)

    def logprobs(self, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor | None:
        """log p(input_ids[:, 1:]) [B, T-1] on the last pipeline stage (None elsewhere); no grad."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        ids = input_ids.to(self.device)
        out: list[torch.Tensor] = []
        vocab = self.arch.vocab_size

        def forward_step(data_iterator, model):
            x = next(data_iterator)
            output = mm.forward_logits(model, x)

            def collect(logits: torch.Tensor):
                logp = mm.vocab_parallel_logprobs(logits[:, :-1], x[:, 1:], vocab, temperature)
                out.append(logp)
                return logp.sum(), {}

            return output, collect

        with torch.no_grad():
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter([ids]),
                model=[self.model],
                num_microbatches=1,
                seq_length=ids.shape[1],
                micro_batch_size=ids.shape[0],
                forward_only=True,
            )
        return out[0] if out else None

    def hf_state_dict(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """Full weights under HF names on global rank `dst` (collective over its model-parallel group)."""
        return mm.hf_state_dict(self.model, self.arch, self.te_spec, dst)


def megatron_optimizer(
    ddp_model: torch.nn.Module,
    dtype: torch.dtype,
    lr: float,
    weight_decay: float,
    max_grad_norm: float,
    distributed: bool,
) -> Any:
    """Megatron's Adam (fp32 main params and grads), its distributed optimizer when `distributed`
    (state sharded over data-parallel ranks, parameters all-gathered after each step)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=lr,
        weight_decay=weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.99,  # the torch backend's AdamW betas
        clip_grad=max_grad_norm,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=distributed,
    )
    return get_megatron_optimizer(config, [ddp_model])


def _weighted(seen: list[tuple[LossStats, float]]) -> LossStats:
    fields = [f for f in LossStats.__struct_fields__]
    return LossStats(**{f: sum(getattr(s, f) * w for s, w in seen) for f in fields})
