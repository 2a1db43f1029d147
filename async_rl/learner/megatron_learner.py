"""Megatron-core learner rank (`learner.backend: megatron`): GPTModel with tensor, pipeline and data
parallelism through `parallel_state`, megatron's DDP and (distributed) optimizer, the pipeline
schedule with micro-batches, per-token log-probs by vocab-parallel cross entropy, the same PPO-clip
loss as the torch backend, and weights exported under HF names for sync.

World layout: `learner.world_size` = TP x PP x DP ranks (megatron's default order, TP fastest). Only
the first rank of each model-parallel group (TP rank 0 of stage 0) asks the buffer for its DP shard;
it broadcasts the groups to the rest of its model-parallel group. That rank reports samples/tokens,
the others report 0, so the controller's sums count each sequence once.

Weight sync and the mismatch probe are called on global rank 0 only. With TP = PP = 1 rank 0 holds
a full replica and serves both on demand. With TP or PP > 1 they need every model-parallel rank,
so each `train_step` ends with a collective gather of the HF-named weights to rank 0 and a forward
over the first `probe_samples` sequences; rank 0 serves both from that snapshot (it is exactly the
state after the step, which is what the controller syncs and probes).

megatron-core is imported inside the methods (it is an optional, GPU-side dependency).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from async_rl.cluster.placement import pin_current_process
from async_rl.cluster.resources import free_port
from async_rl.errors import RunError
from async_rl.learner import megatron_model as mm
from async_rl.learner.base import LearnerRank, LearnerSpec, Probe, StepMetrics
from async_rl.learner.batch_client import BatchClient
from async_rl.learner.losses import PolicyLossStats as LossStats
from async_rl.learner.losses import policy_loss
from async_rl.learner.megatron_batch import Collated
from async_rl.learner.megatron_convert import HFArch
from async_rl.protocol import TrajectoryGroup
from async_rl.weight_sync.base import UpdateReceipt, WeightGroupInfo
from async_rl.weight_sync.bucketing import Manifest
from async_rl.weight_sync.checksum import ParamChecksum

from .weight_source import WeightSource


class MegatronSettings(msgspec.Struct, frozen=True, kw_only=True):
    tensor_parallel_size: int
    pipeline_parallel_size: int
    micro_batches: int
    distributed_optimizer: bool
    transformer_engine: str  # 'auto' | 'on' | 'off'
    probe_samples: int  # sequences the post-step probe scores when TP or PP > 1
    device: str  # 'cuda' | 'cpu' (megatron_cpu: gloo, float32, for tests and debugging)


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
    ) -> None:
        """`make_optimizer(ddp_model)` replaces megatron's optimizer (whose code allocates on 'cuda'
        unconditionally): the CPU tests pass a stand-in with the same step/zero_grad/scale_loss."""
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        self.arch = arch
        self.te_spec = te_spec
        model = mm.build_model(arch, dtype, cpu_init=cpu_init, te_spec=te_spec)
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


class MegatronLearnerRank(LearnerRank):
    def __init__(
        self,
        settings: LearnerSpec,
        megatron: MegatronSettings,
        rank: int,
        world_size: int,
        master: str,
        cores: list[int],
    ) -> None:
        pin_current_process(cores)
        self.s = settings
        self.m = megatron
        self.rank = rank
        self.world_size = world_size
        self.master = master
        self._weights = WeightSource(settings.weight_sync, self._named_tensors)
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._probe: Probe | None = None
        self._last_batch: Collated | None = None
        self.batches: BatchClient | None = None

    def rendezvous_address(self) -> str:
        import ray

        host = ray.util.get_node_ip_address()  # the other ranks may run on other nodes
        self.master = f"{host}:{free_port(host)}"
        return self.master

    def setup(self) -> int:
        on_cpu = self.m.device == "cpu"
        if not on_cpu and not torch.cuda.is_available():
            raise RunError(
                "learner.megatron.device=cuda but this rank sees no CUDA device "
                "(learner.megatron.device=cpu runs megatron on the CPU with gloo, for tests and debugging)"
            )
        try:
            from megatron.core import parallel_state, tensor_parallel
        except ImportError:
            raise RunError("learner.backend=megatron needs megatron-core: pip install -e '.[gpu]'") from None

        dtype = getattr(torch, self.s.model.dtype)
        te_spec = use_transformer_engine(self.m.transformer_engine) and not on_cpu
        if on_cpu:
            from async_rl.learner import megatron_cpu

            megatron_cpu.check_config(dtype=dtype, distributed_optimizer=False, te_spec=te_spec)
            megatron_cpu.enable()
        else:
            torch.cuda.set_device(0)  # Ray gives each rank one visible GPU
        host, port = self.master.rsplit(":", 1)
        dist.init_process_group(
            "gloo" if on_cpu else "nccl",
            init_method=f"tcp://{host}:{port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=300),
        )
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.m.tensor_parallel_size,
            pipeline_model_parallel_size=self.m.pipeline_parallel_size,
        )
        if not on_cpu:
            tensor_parallel.model_parallel_cuda_manual_seed(self.s.train.seed)
        torch.manual_seed(self.s.train.seed)
        self.arch = mm.load_arch(self.s.model_dir)
        # On CPU with one data-parallel replica the distributed optimizer would shard nothing; with
        # more, config validation refuses it (megatron's version checks for CUDA tensors).
        distributed = self.m.distributed_optimizer and not on_cpu
        self.policy = MegatronPolicy(
            self.arch,
            mm.SafetensorsCheckpoint(self.s.model_dir),
            dtype=dtype,
            lr=self.s.learner.lr,
            weight_decay=self.s.learner.weight_decay,
            max_grad_norm=self.s.learner.max_grad_norm,
            distributed_optimizer=distributed,
            te_spec=te_spec,
            cpu_init=on_cpu,
        )
        self.model_parallel = self.m.tensor_parallel_size * self.m.pipeline_parallel_size
        self.is_fetcher = (
            parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_pipeline_model_parallel_rank() == 0
        )
        self.batches = (
            BatchClient(
                self.s.buffer_address,
                self.s.run_id,
                parallel_state.get_data_parallel_rank(),
                parallel_state.get_data_parallel_world_size(),
                self.s.curve,
            )
            if self.is_fetcher
            else None
        )
        if self.model_parallel > 1:
            self._snapshot = self._copy(self.policy.hf_state_dict())  # collective; None off rank 0
        # parameter count of the whole model, as the torch backend reports it
        return sum(math.prod(shape) for shape in mm.hf_param_shapes(self.arch, 1, 0).values())

    # ---- training -------------------------------------------------------------------------------

    def _fetch(self, step: int) -> list[Any]:
        """This DP rank's groups, fetched once per model-parallel group and broadcast within it."""
        from megatron.core import parallel_state

        groups = self.batches.fetch(step, self.s.batch_timeout_s) if self.is_fetcher else None
        if self.model_parallel == 1:
            return groups
        group = parallel_state.get_model_parallel_group()
        box = [groups]
        dist.broadcast_object_list(
            box, src=dist.get_global_rank(group, 0), group=group, device=self.policy.device
        )
        return box[0]

    def train_step(self, step: int) -> StepMetrics:
        t0 = time.perf_counter()
        groups = self._fetch(step)
        metrics = self.train_on_shard(step, groups)
        return msgspec.structs.replace(metrics, wait_s=time.perf_counter() - t0 - metrics.compute_s)

    def train_on_shard(self, step: int, groups: list[TrajectoryGroup]) -> StepMetrics:
        t1 = time.perf_counter()
        b = Collated(groups)
        self._last_batch = b
        stats, grad_norm = self.policy.train_batch(
            b, self.m.micro_batches, self.s.generators.temperature, self.s.algorithm.clip_eps_low, self.s.algorithm.clip_eps_high,
            self.s.algorithm.tis_cap,
        )
        stats = self._from_last_stage(stats)
        if self.model_parallel > 1:
            self._snapshot = self._copy(self.policy.hf_state_dict())
            self._probe = self._score(b, self.m.probe_samples)
        counted = self.is_fetcher  # TP/PP peers train on the same sequences: count them once
        return StepMetrics(
            step=step,
            rank=self.rank,
            loss=stats.loss,
            reward_mean=float(b.rewards.mean()),
            kl_behav=stats.kl_behav,
            logprob_abs_diff=stats.logprob_abs_diff,
            grad_norm=grad_norm,
            clip_frac=stats.clip_frac,
            tis_frac=stats.tis_frac,
            samples=int(b.input_ids.shape[0]) if counted else 0,
            tokens=b.tokens if counted else 0,
            wait_s=0.0,
            compute_s=time.perf_counter() - t1,
        )

    @staticmethod
    def _copy(weights: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        """The snapshot served between steps: TP-replicated tensors come back as the live parameters,
        which the next step would change under a sync that is reading them."""
        return None if weights is None else {n: t.detach().clone() for n, t in weights.items()}

    def _from_last_stage(self, stats: LossStats | None) -> LossStats:
        """Every pipeline stage reports the loss statistics the last stage computed."""
        from megatron.core import parallel_state

        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return stats
        group = parallel_state.get_pipeline_model_parallel_group()
        fields = list(LossStats.__struct_fields__)
        values = torch.zeros(len(fields), dtype=torch.float64, device=self.policy.device)
        if stats is not None:
            values.copy_(torch.tensor([getattr(stats, f) for f in fields], dtype=torch.float64))
        dist.broadcast(values, src=dist.get_process_group_ranks(group)[-1], group=group)
        return LossStats(**dict(zip(fields, values.tolist(), strict=True)))

    # ---- probe and weights (rank 0) ---------------------------------------------------------------

    def _score(self, b: Collated, max_samples: int) -> Probe | None:
        """Current-weight log-probs (temperature 1, as vLLM's prompt log-probs) on completion tokens
        of up to `max_samples` sequences of `b`. Collective when TP or PP > 1."""
        from megatron.core import parallel_state

        n = min(max_samples, len(b.seqs))
        if n == 0:
            return Probe(token_ids=[], positions=[], logprobs=[])
        logp = self.policy.logprobs(b.input_ids[:n])
        if self.model_parallel > 1 and parallel_state.get_pipeline_model_parallel_world_size() > 1:
            group = parallel_state.get_pipeline_model_parallel_group()
            ranks = dist.get_process_group_ranks(group)
            if logp is None:
                logp = torch.empty(n, b.input_ids.shape[1] - 1, device=self.policy.device)
            dist.broadcast(logp, src=ranks[-1], group=group)
        logp = logp.cpu()
        token_ids, positions, values = [], [], []
        for i in range(n):
            cols = b.loss_mask[i].nonzero().flatten().tolist()
            token_ids.append(b.seqs[i].tolist())
            positions.append([c + 1 for c in cols])
            values.append(logp[i, cols].tolist())
        return Probe(token_ids=token_ids, positions=positions, logprobs=values)

    def probe_logprobs(self, max_samples: int) -> Probe:
        if self._last_batch is None:
            raise RunError("probe_logprobs before any train_step")
        if self.model_parallel == 1:
            return self._score(self._last_batch, max_samples)
        probe = self._probe or Probe(token_ids=[], positions=[], logprobs=[])
        n = min(max_samples, len(probe.token_ids))
        return Probe(token_ids=probe.token_ids[:n], positions=probe.positions[:n], logprobs=probe.logprobs[:n])

    def _named_tensors(self) -> dict[str, torch.Tensor]:
        if self.model_parallel == 1:
            return self.policy.hf_state_dict()
        if self._snapshot is None:
            raise RunError("megatron rank 0 has no gathered weights yet")
        return self._snapshot

    def weight_manifest(self) -> Manifest:
        return self._weights.manifest()

    def open_weight_group(self, world_size: int) -> WeightGroupInfo:
        return self._weights.open(world_size)

    def join_weight_group(self) -> None:
        self._weights.join()

    def broadcast_weights(self, version: int) -> UpdateReceipt:
        return self._weights.broadcast(version)

    def param_checksum(self) -> ParamChecksum:
        return self._weights.checksum()

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Rank 0: the full current model under HF names (for checkpoints in HF format)."""
        return self._named_tensors()

    def hf_weights(self) -> dict[str, torch.Tensor]:
        return self._named_tensors()

    def compute_logprobs(self, groups: list[TrajectoryGroup], temperature: float = 1.0) -> list[np.ndarray]:
        if self.model_parallel > 1:
            raise RunError("learner.backend=megatron: compute_logprobs with tensor/pipeline parallelism > 1 is not implemented")
        b = Collated(groups)
        with torch.no_grad():
            logp = self.policy.logprobs(b.input_ids, temperature).float().cpu()
        return [logp[i, s : s + n].numpy().copy() for i, (s, n) in enumerate(zip(b.starts, b.lengths, strict=True))]

    def save_checkpoint(self, directory: str) -> None:
        raise RunError(
            "learner.backend=megatron: checkpoints are not implemented yet (set train.checkpoint_every=0 and "
            "train.checkpoint_at_end=false, or use learner.backend=torch)"
        )

    def load_checkpoint(self, directory: str) -> int:
        raise RunError("learner.backend=megatron: resuming from a checkpoint is not implemented yet")

    def shutdown(self) -> None:
        self._weights.close()
        if self.batches is not None:
            self.batches.close()
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except ImportError:
            pass
        if dist.is_initialized():
            dist.destroy_process_group()
