"""The torch model backend: an HF causal LM under DDP or FSDP2 (gloo on CPU, nccl on GPU), AdamW.

Data parallel, optionally times Ulysses sequence parallel (`learner.sequence_parallel_size`,
`model/ulysses.py`): the first rank of each SP group fetches the shard and shares it with its group;
every rank has outputs. See backend.py for the contract.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch.profiler import record_function

from async_rl.config import LearnerConfig, VisionConfig
from async_rl.errors import RunError
from async_rl.learner.backend import Adapter, LossFn, ModelBackend, ParallelInfo, TokenScores
from async_rl.learner.batch.cut import MicroBatchCut
from async_rl.learner.batch.packing import MicroBatch
from async_rl.learner.hf_io import read_hf_weights, read_model_files, write_hf_folder
from async_rl.learner.model import ulysses
from async_rl.learner.model.attention import register
from async_rl.learner.model.attention import resolve as resolve_attention
from async_rl.learner.model.head import keeps_logits, model_scores, unsupported
from async_rl.learner.model.head_fused import FusedPath
from async_rl.learner.model.head_probe import HeadProbe, agreed_measure, chosen
from async_rl.learner.model.kernels import apply_kernels, compile_layers, decoder_layers
from async_rl.learner.model.moe import MoeShape, RouterReplay, moe_shape, set_experts
from async_rl.learner.model.precision import WorkingCopy, all_reduce_grads
from async_rl.learner.model.vision_inputs import VisionInputs, frozen_vision_tower, unused_tower_weights
from async_rl.learner.moe_settings import settings_error
from async_rl.learner.optimizer import adamw
from async_rl.learner.rendezvous import join_group
from async_rl.learner.rl.reference import RowShare
from async_rl.models.cost import path_of
from async_rl.protocol import TrajectoryGroup
from async_rl.vision import is_vision_model

OPTIMIZER_STATE = "optimizer.pt"


class ScoringModel(torch.nn.Module):
    """The HF model with its output layer applied at the scored positions only (`head.model_scores`).
    It is the module DDP and FSDP2 wrap, so the head runs inside their forward: DDP sees the output
    weight used, FSDP2's root has gathered it."""

    def __init__(self, model: torch.nn.Module, chunk: int, fused_head: FusedPath, keep_logits: bool = False) -> None:
        super().__init__()
        self.model = model
        self.chunk = chunk
        self.fused_head = fused_head
        self.keep_logits = keep_logits

    def forward(self, inputs: dict, targets: torch.Tensor, index: torch.Tensor, temperature: float,
                hidden: bool, head: bool, entropy: bool = True):
        return model_scores(self.model, inputs, targets, index, temperature, self.chunk, hidden=hidden,
                            head=head, entropy=entropy, fused=self.fused_head, keep_logits=self.keep_logits)


def rank_device(device: str) -> torch.device:
    """This rank's device from learner.device. On cuda Ray gave the rank one GPU and set its
    CUDA_VISIBLE_DEVICES to it, so it is cuda:0 here; never LOCAL_RANK % device_count, which on a
    node where the rank sees every GPU (one that asked Ray for none) puts every rank on GPU 0.
    cpu: the CPU even where GPUs are visible. auto (a spec not made by the launcher): cuda:0 when
    this process sees a GPU."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RunError("learner.device=cuda but this learner rank sees no CUDA device")
    return torch.device("cuda", 0)


def routing_replay(cfg: LearnerConfig, moe: MoeShape | None) -> bool:
    """learner.routing_replay for this model (auto: on for an MoE model), and the settings an MoE model
    does not take, refused in one line."""
    if why := settings_error(cfg, 0 if moe is None else moe.experts):
        raise RunError(why)
    return moe is not None and cfg.routing_replay != "off"


class TorchBackend(ModelBackend):
    def __init__(
        self, cfg: LearnerConfig, dtype: str, rank: int, world_size: int, master: str,
        rendezvous_store: dist.TCPStore | None = None, vision: VisionConfig | None = None,
    ) -> None:
        """`master`: the group's store ('host:port'); `rendezvous_store`: rank 0's, already listening
        there (`rendezvous.host_store`), or None for rank 0 to start it on that port; `vision`: a
        vision-language model's pixel bounds (the engines')."""
        self.cfg = cfg
        self.vision = vision or VisionConfig()
        self.dtype = getattr(torch, dtype)
        self.rank = rank
        self.world_size = world_size
        self.master = master
        self.rendezvous_store = rendezvous_store
        self._full: dict[str, torch.Tensor] | None = None  # FSDP2: gathered full weights (rank 0)
        self.peft = None  # learner.lora: the PeftModel around self.model (see learner/model/lora.py)
        self.working: WorkingCopy | None = None  # mixed_precision=bf16_params: what the forward runs on
        self.head_probe: HeadProbe | None = None  # learner.head_kernel auto on CUDA: what was measured
        self.router_replay: RouterReplay | None = None  # MoE models: the routers' hooks (learner/model/moe.py)
        self.replays_routes = False  # learner.routing_replay as it runs

    @property
    def sharded(self) -> bool:
        return self.cfg.parallel == "fsdp2"

    @property
    def takes_block_masks(self) -> bool:
        return True  # HF attention takes a 4D mask as it is (SDPA and eager)

    @property
    def weights_are_live(self) -> bool:
        return not self.sharded

    def setup(self, model_dir: str) -> int:
        from transformers import AutoModelForCausalLM

        self.device = rank_device(self.cfg.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        sp = self.cfg.sequence_parallel_size
        if self.world_size % sp:  # every rank raises alike, before any group waits for a peer
            raise RunError(f"learner.sequence_parallel_size={sp} does not divide learner.world_size={self.world_size}")
        if self.world_size > 1 or self.sharded:  # FSDP2 needs a process group even for one rank
            join_group("nccl" if self.device.type == "cuda" else "gloo", self.master, self.rank, self.world_size,
                       self.rendezvous_store)
        self.groups = ulysses.join(sp, self.rank, self.world_size)  # SP = 1: no new group
        self.info = ParallelInfo(
            rank=self.rank, world_size=self.world_size, dp_rank=self.groups.dp_rank, dp_size=self.groups.dp_size,
            fetches_batch=self.groups.rank == 0, has_outputs=True, counts_samples=self.groups.rank == 0,
        )
        if is_vision_model(model_dir):
            self.model = self._vision_model(model_dir, sp)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.dtype)
        self._kv_repeat = self._check_sequence_parallel(self.model.config)
        self.moe = moe_shape(self.model)
        self.replays_routes = routing_replay(self.cfg, self.moe)
        if self.moe is not None:
            self.experts_kernel = set_experts(self.model, self.cfg.moe_experts)  # before a working copy copies the config
        if self.cfg.lora.enabled:
            from async_rl.learner.model.lora import adapter_config_dict, apply_lora

            # PEFT injects its layers into self.model in place; the rest of the backend keeps using the
            # HF model (now with the adapter), and only the adapter requires grad. A VLM's adapter goes
            # on its language model alone (what vLLM serves LoRA on); the vision tower and its projector
            # stay frozen with the rest of the base.
            self.peft = apply_lora(self.model, self.cfg.lora, vision=self.vision_inputs is not None)
            self._adapter_config = adapter_config_dict(self.peft, model_dir)
        if self.cfg.activation_checkpointing:
            # Non-reentrant: gradients reach the layers' weights even when the layer's input needs none
            # (LoRA: the frozen embedding's output), and it nests with compile and FSDP2.
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.hidden_size = int(self.model.config.get_text_config().hidden_size)
        self._model_files = read_model_files(Path(model_dir))  # config + tokenizer for checkpoints
        self.model.to(self.device).train()
        if self.cfg.logprob_chunk_tokens and (why := unsupported(self.model)):
            raise RunError(f"learner.logprob_chunk_tokens: the chunked head cannot score this model ({why}); set it to 0")
        half = self._compute_dtype() is not None or self.dtype in (torch.bfloat16, torch.float16)
        try:
            # a VLM's vision tower runs the model's own attention: sdpa, not the registry's kernels
            setting = "sdpa" if self.vision_inputs is not None else self.cfg.attention
            self.attention_kernels = resolve_attention(setting, self.device.type, half)
        except ValueError as e:
            raise RunError(f"learner.attention={self.cfg.attention}: {e}") from None
        self.attention_path = path_of(self.attention_kernels.unshared, self.device.type)
        if self.groups.size > 1:
            # the exchange around every kernel (ulysses.py); set before the bf16 working copy is made, as below
            self.model.set_attn_implementation(ulysses.register())
        elif self.attention_kernels.uses_registry:
            # varlen/flex (attention.py); SDPA otherwise. Set before the bf16 working copy is made: it copies the config.
            self.model.set_attn_implementation(register())
        self._param_names = [name for name, _ in self.model.named_parameters()]
        compute = self._compute_dtype()
        self._autocast = None
        if self._working_copy():
            self.working = WorkingCopy(self.model, compute)
        compute_model = self.working.module if self.working else self.model
        if self.moe is not None:  # on the module the forward runs on (the working copy's own routers)
            self.router_replay = RouterReplay(compute_model)
        self.kernels = apply_kernels(self.cfg.kernels, compute_model, self.device)
        if self.cfg.compile and self.kernels != "compile":
            compile_layers(compute_model)
        self.head_probe = self._probe_head(compute_model, compute or self.dtype)
        self.head_kernel, self.fused_head = chosen(self.head_probe, self.cfg.head_kernel, self.device.type)
        self.keeps_logits = keeps_logits(self.cfg.logprob_keep_logits, self.device.type)
        self.scorer = ScoringModel(compute_model, self.cfg.logprob_chunk_tokens, self.fused_head, self.keeps_logits)
        if self.working:
            self.wrapped = self.scorer  # gradients land in the fp32 masters: reduced after the last micro-batch
        elif self.sharded:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = init_device_mesh(self.device.type, (self.world_size,))
            policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if compute else None
            kwargs = {"mesh": mesh, **({"mp_policy": policy} if policy else {})}
            layers = decoder_layers(self.model)
            if not layers:
                raise RunError("learner.parallel=fsdp2: the model names no decoder layer class (_no_split_modules)")
            for layer in layers:
                fully_shard(layer, **kwargs)
            fully_shard(self.scorer, **kwargs)  # the root: its forward (the head included) gathers the rest
            self.wrapped = self.scorer
        else:
            self._autocast = compute
            if self.world_size > 1:
                ids = [self.device.index] if self.device.type == "cuda" else None
                self.wrapped = torch.nn.parallel.DistributedDataParallel(self.scorer, device_ids=ids)
            else:
                self.wrapped = self.scorer
        # torch's fused AdamW: the same update as its CPU default (the for-loop), 5x faster here (optimizer.py).
        self.optimizer = adamw(
            [p for p in self.model.parameters() if p.requires_grad], lr=self.cfg.lr, weight_decay=self.cfg.weight_decay
        )
        return sum(p.numel() for p in self.model.parameters())

    def _vision_model(self, model_dir: str, sp: int) -> torch.nn.Module:
        """A vision-language model (its image-text-to-text class), its vision tower frozen by
        learner.freeze_vision (the projector trains: Qwen's patch merger, LLaVA's multi_modal_projector); the settings it cannot take
        refused in one line each."""
        from transformers import AutoModelForImageTextToText

        if sp > 1:
            raise RunError(f"learner.sequence_parallel_size={sp}: vision-language models train without sequence parallelism (set 1)")
        if self.cfg.attention in ("varlen", "flex"):
            raise RunError(f"learner.attention={self.cfg.attention}: vision-language models train with sdpa (set sdpa or auto)")
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=self.dtype)
        self.vision_inputs = VisionInputs(model, model_dir, self.vision)  # refuses a family not built
        if self.cfg.freeze_vision:
            frozen_vision_tower(model, self.vision_inputs.vision.family)
        return model

    def _check_sequence_parallel(self, config) -> int:
        """The K/V heads' repeat count of learner.sequence_parallel_size on this model (1 without SP), or
        the one line that says why it cannot split it."""
        if self.groups.size == 1:
            return 1
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        if why := ulysses.check(self.groups.size, self.world_size, heads):
            raise RunError(f"learner.sequence_parallel_size={self.groups.size} {why}")
        return ulysses.kv_repeat(self.groups.size, kv_heads)

    def _probe_head(self, model: torch.nn.Module, compute: torch.dtype) -> HeadProbe | None:
        """learner.head_kernel auto on CUDA: the head's kernels timed on the model's own output layer
        (`head_probe`), agreed over ranks and stated in one line by rank 0; None elsewhere (the setting
        names the kernel)."""
        chunk = self.cfg.logprob_chunk_tokens
        if self.cfg.head_kernel != "auto" or self.device.type != "cuda" or not chunk:
            return None
        weight = model.get_output_embeddings().weight
        return agreed_measure(weight, chunk, compute, lambda t: self.all_reduce(t, "max"), self.rank == 0)

    def _compute_dtype(self) -> torch.dtype | None:
        """bf16 compute on CUDA (parameters and optimizer stay in `model.dtype`); none on CPU."""
        mode = self.cfg.mixed_precision
        if mode in ("bf16", "bf16_params") or (mode == "auto" and self.device.type == "cuda"):
            return torch.bfloat16
        return None

    def _working_copy(self) -> bool:
        """Whether the forward runs on a bf16 working copy (`precision.py`): bf16_params, and auto on
        CUDA, for one rank and DDP over full-parameter training. FSDP2's mixed-precision policy is the
        sharded form of the same thing; LoRA keeps autocast (its frozen base would be a second copy for
        a few trainable weights)."""
        mode = self.cfg.mixed_precision
        if mode == "bf16_params" and self.peft is not None:
            raise RunError("learner.mixed_precision=bf16_params: not with learner.lora (use bf16 or auto)")
        if self.sharded or self.peft is not None or self.model.dtype != torch.float32:
            return False
        return mode == "bf16_params" or (mode == "auto" and self.device.type == "cuda")

    # ---- forward and backward ---------------------------------------------------------------------

    def _forward(self, mb: MicroBatch, temperature: float, index: torch.Tensor, hidden: bool,
                 head: bool = True, with_entropy: bool = True) -> TokenScores:
        """`index`: the flat positions the head scores (long [N], a host tensor built from the packing
        plan); it travels with the batch, so the head's gather waits on no host sync."""
        if self.working:
            self.working.refresh_if_stale()  # once per optimizer step, not per micro-batch
        autocast = (
            torch.autocast(self.device.type, dtype=self._autocast) if self._autocast else contextlib.nullcontext()
        )
        if self.groups.size > 1:
            return self._forward_sequence_parallel(mb, temperature, index, hidden, head, with_entropy, autocast)
        with autocast:
            logp, entropy, last = self.wrapped(
                mb.model_inputs(self.device, self.attention_kernels), mb.targets.to(self.device),
                self._to_device(index), temperature, hidden, head, with_entropy,
            )
        return TokenScores(logp=logp, entropy=entropy, hidden=last.detach() if hidden else None)

    def _forward_sequence_parallel(self, mb: MicroBatch, temperature: float, index: torch.Tensor, hidden: bool,
                                   head: bool, with_entropy: bool, autocast) -> TokenScores:
        """`_forward` on this rank's slice of the micro-batch's tokens (`ulysses.split`), its per-token
        scores gathered over the SP group into the micro-batch's layout (`ulysses.gather`)."""
        local = ulysses.split(mb.input_ids, mb.targets, mb.segments, index, self.groups, self.attention_kernels,
                              self._kv_repeat, self.device)
        with autocast:
            logp, entropy, last = self.wrapped(local.inputs, local.targets, local.index, temperature, hidden, head,
                                               with_entropy)
        g = self.groups
        last = ulysses.gather(last.detach(), local, g) if hidden else None
        return TokenScores(logp=ulysses.gather(logp, local, g), entropy=ulysses.gather(entropy, local, g), hidden=last)

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A tensor on this rank's device; a host tensor bound for CUDA is copied from pinned memory
        without blocking (the driver may have moved the batch, and its index, there already)."""
        if self.device.type != "cuda" or host.is_cuda:
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def _routing(self, mb: MicroBatch, replay: bool, aux: bool = False):
        """MoE models: the routing plan of one micro-batch's forward (and backward, whose checkpoint
        recompute replays the same routes); a null context for a dense model."""
        if self.router_replay is None:
            return contextlib.nullcontext(None)
        return self.router_replay.plan(mb.routes, replay, aux)

    def score(self, mb: MicroBatch, temperature: float, *, hidden: bool = False, head: bool = True) -> TokenScores:
        return self.score_routing(mb, temperature, self.replays_routes, hidden=hidden, head=head)

    def score_routing(self, mb: MicroBatch, temperature: float, replay: bool, *, hidden: bool = False,
                      head: bool = True) -> TokenScores:
        with torch.no_grad(), self._routing(mb, replay):  # the completion positions of its sequences (`spans`)
            # No entropy: the scoring passes read log-probs (and hidden states) only.
            return self._forward(mb, temperature, mb.span_index(), hidden, head, with_entropy=False)

    def forward_backward(self, mbs: list[MicroBatch], temperature: float, loss_fn: LossFn) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._full = None  # gathered weights go stale with this step
        aux = self.cfg.moe_aux_loss_coef > 0
        for i, mb in enumerate(mbs):
            with self._grad_sync(i == len(mbs) - 1), self._routing(mb, self.replays_routes, aux) as plan:
                scores = self._forward(mb, temperature, mb.head_index(), hidden=False)
                if plan is not None:
                    scores.router = self.router_replay.stats(plan)
                loss = loss_fn(i, scores)
                # DDP and FSDP2 average gradients over ranks; the contract is their sum.
                with record_function("learner.backward"):  # a profiler's region, as the head's
                    (loss * (1 if self.working else self.world_size)).backward()
        if self.working and self.world_size > 1:
            all_reduce_grads(list(self.model.parameters()))  # fp32 sums, once per step

    def _grad_sync(self, sync: bool):
        """Accumulate gradients locally except on the last micro-batch, which reduces them once."""
        if self.sharded:
            self.wrapped.set_requires_gradient_sync(sync)
            return contextlib.nullcontext()
        if sync or self.wrapped is self.scorer:
            return contextlib.nullcontext()
        return self.wrapped.no_sync()

    def optimizer_step(self, lr: float, max_grad_norm: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm)
        value = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        # DDP and FSDP2 norms are global already; the flag is reduced anyway, so no rank can step alone.
        bad = torch.tensor([0.0 if math.isfinite(value) else 1.0])
        if float(self.all_reduce(bad, "max")[0]) > 0:
            self.drop_gradients()  # clipping by a NaN norm made them NaN: AdamW must not see them
            return value if not math.isfinite(value) else math.nan
        with record_function("learner.optimizer"):
            self.optimizer.step()
        self._full = None
        if self.working:
            self.working.mark_stale()
        return value

    def drop_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def all_reduce(self, x: torch.Tensor, op: Literal["sum", "max"] = "sum") -> torch.Tensor:
        if not dist.is_initialized() or self.world_size == 1:
            return x
        y = x.to(self.device if self.device.type == "cuda" else "cpu").clone()
        # over the data-parallel group: an SP group's ranks hold the same numbers (None: every rank)
        dist.all_reduce(y, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.groups.data)
        return y.to(x.device)

    def share_shard(self, groups: list[TrajectoryGroup] | None) -> list[TrajectoryGroup]:
        """The SP group's first rank fetched the shard; its peers train the same one."""
        if self.groups.size == 1:
            assert groups is not None
            return groups
        box = [groups]
        dist.broadcast_object_list(box, src=self.groups.first, group=self.groups.sequence, device=self.device)
        return box[0]

    # ---- weights ------------------------------------------------------------------------------------

    def gather_weights(self) -> None:
        if not self.sharded or self._full is not None:
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # CPU: only rank 0 keeps the gathered copy. CUDA: every rank does (the NCCL sender needs
        # device tensors), at the cost of one full copy of the weights per GPU during the sync.
        offload = self.device.type == "cpu"
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
        self._full = {name: full[name] for name in self._param_names} if full else {}

    def adapter(self) -> Adapter | None:
        if self.peft is None:
            return None
        from async_rl.learner.model.lora import adapter_parameters, is_adapter, saved_name

        if not self.sharded:
            return Adapter(adapter_parameters(self.model), self._adapter_config)
        if self._full is None:
            raise RuntimeError("learner.parallel=fsdp2: adapter before gather_weights")
        return Adapter({saved_name(n): t for n, t in self._full.items() if is_adapter(n)}, self._adapter_config)

    def base_reference(self, cut: MicroBatchCut, logprob_chunk_tokens: int, head_kernel: str = "eager"):
        if self.peft is None or self.sharded:
            return None  # FSDP2 shards the model: its forward outside the root would miss the gathers
        from async_rl.learner.model.lora import adapter_disabled
        from async_rl.learner.rl.reference import ReferencePolicy

        return ReferencePolicy.of_base(
            self.model, lambda: adapter_disabled(self.peft), cut=cut, logprob_chunk_tokens=logprob_chunk_tokens,
            head_kernel=head_kernel, share=self.reference_share(),
        )

    def reference_share(self) -> RowShare | None:
        g = self.groups
        return RowShare(g.size, g.rank, g.sequence) if g.size > 1 else None

    def synced_weights(self) -> dict[str, torch.Tensor]:
        weights = self.hf_weights()
        if self.vision_inputs is None or not self.cfg.freeze_vision:
            return weights
        trains = {name for name, p in self.model.named_parameters() if p.requires_grad}
        return {name: t for name, t in weights.items() if name in trains}

    def served_weights(self) -> dict[str, torch.Tensor]:
        weights = self.hf_weights()
        if self.vision_inputs is None:
            return weights
        unused = unused_tower_weights(self.model, self.vision_inputs.vision.family)
        return {name: t for name, t in weights.items() if not unused(name)}

    def weights_gathered(self) -> bool:
        return not self.sharded or self._full is not None

    def hf_weights(self) -> dict[str, torch.Tensor]:
        # named_parameters() lists a tied weight once, under its first name: what vLLM's loader expects.
        if not self.sharded:
            return dict(self.model.named_parameters())
        if self._full is None:
            raise RuntimeError("learner.parallel=fsdp2: hf_weights before gather_weights")
        return self._full

    # ---- checkpoints --------------------------------------------------------------------------------

    def save(self, directory: str) -> None:
        from async_rl.learner.base import checkpoint_adapter_dir, checkpoint_model_dir

        d = Path(directory)
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            self.gather_weights()
            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            optim = get_optimizer_state_dict(self.model, self.optimizer, options=opts)
        else:
            optim = self.optimizer.state_dict()  # replicas: rank 0's is everyone's
        if self.rank == 0:
            if self.peft is not None:  # the adapter alone, in PEFT's format (the base never changes)
                from async_rl.learner.model.lora import save_adapter

                adapter = self.adapter()
                save_adapter(checkpoint_adapter_dir(d), adapter.tensors, adapter.config)
            else:
                write_hf_folder(checkpoint_model_dir(d), self._model_files, self.hf_weights())
            torch.save({"optimizer": optim, "parallel": self.cfg.parallel, "world_size": self.world_size},
                       d / OPTIMIZER_STATE)

    def load(self, directory: str) -> None:
        from async_rl.learner.base import checkpoint_model_dir

        d = Path(directory)
        weights = self._read_adapter(d) if self.peft is not None else read_hf_weights(checkpoint_model_dir(d))
        missing = [n for n in self._param_names if n not in weights]
        if missing:
            raise RunError(f"checkpoint '{d}': model weights miss {len(missing)} parameter(s), e.g. '{missing[0]}'")
        # Our own file (optimizer state plus Python objects): not an untrusted download.
        state = torch.load(d / OPTIMIZER_STATE, map_location="cpu", weights_only=False)
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, strict=False)
            names = [n for n in self._param_names if self.peft is None or ".lora_" in n]  # LoRA: the adapter only
            set_model_state_dict(self.model, {n: weights[n] for n in names}, options=opts)
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=opts)
        else:
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    p.copy_(weights[name])
            self.optimizer.load_state_dict(state["optimizer"])
        self._full = None
        if self.working:
            self.working.mark_stale()

    def _read_adapter(self, d: Path) -> dict[str, torch.Tensor]:
        """The checkpoint's adapter under the HF model's parameter names, with the base weights as they
        are (frozen: the same as at setup), so the loading below treats both alike."""
        from async_rl.learner.base import checkpoint_adapter_dir
        from async_rl.learner.model.lora import is_adapter, load_adapter, saved_name

        tensors, _ = load_adapter(checkpoint_adapter_dir(d))
        out = {}
        for name, p in self.model.named_parameters():
            key = saved_name(name) if is_adapter(name) else None
            if key is not None and key not in tensors:
                raise RunError(f"checkpoint '{d}': the adapter misses '{key}'")
            out[name] = tensors[key] if key is not None else p.detach()
        return out

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
