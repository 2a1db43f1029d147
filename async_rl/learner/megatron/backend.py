"""Megatron-core model backend (`learner.backend: megatron`) behind the `ModelBackend` interface:
GPTModel with tensor, pipeline and data parallelism, megatron's DDP, optimizer and pipeline
schedules; everything that is not the model (algorithms, micro-batching, the weights lock, sync,
checkpoint bookkeeping, LR schedule) is the driver's.

World layout: megatron's default rank order (`tp-cp-ep-dp-pp`, TP fastest); `ParallelInfo` is read
back from `parallel_state`, so the driver never computes it. The first rank of each model-parallel group (TP rank 0 of stage 0) fetches
its DP shard and `share_shard` broadcasts it to its peers; output ranks are the last stage.

Micro-batches of both layouts from `packing` run through megatron. A packed micro-batch (a sequence
starts where its position id is 0):
- with Transformer Engine, goes in as megatron's packed-sequence format: its rows flattened into one
  row of tokens with `PackedSeqParams(qkv_format="thd", cu_seqlens)` (read from the packing's
  segment table: `packed_bounds`), no mask. TE's attention reads
  only the sequence boundaries (it ignores an `attention_mask` under `attn_mask_type=causal`, so a
  block-diagonal mask would let packed sequences attend across their boundaries), and megatron
  applies RoPE per sequence from the same cu_seqlens.
- with the local spec (no TE; the CPU path), keeps a block-diagonal causal mask built from its
  position ids on the device (only the position ids are copied): megatron's `DotProductAttention` refuses packed-sequence params, and its unfused
  softmax (`masked_softmax_fusion=False`) applies a given mask as is, generating the causal one only
  when none is given. RoPE is relative, so positions that do not restart change nothing once no
  token attends across a boundary. With `learner.megatron.attention` sdpa (`megatron.attention`) the
  same mask goes to torch's SDPA, additive in the model dtype, built once per micro-batch; with
  varlen (auto on CUDA in bf16) the micro-batch goes flattened to one row with the same cu_seqlens
  (`megatron.attention.packed_row`: not THD, so megatron rotates the row whole rather than sequence
  by sequence) to varlen flash attention, no mask.
A padded row is right-padded, so the causal mask is enough. With pipeline parallelism all
micro-batches of a step are padded to one shape (megatron's p2p sends fixed-shape activations).

`device=cpu` runs on gloo in float32 under the `cpu` patches (tests, debugging).

The output layer (`logprob_chunk_tokens` > 0) runs outside GPTModel's forward: during a step the last
stage returns its final hidden states, and `_head_scores` applies the (vocab-parallel) output layer
at the positions that need scores only (the loss mask in training, the completion positions in
`score`), `chunk` positions at a time (`megatron.head`): one softmax per chunk gives the log-probs
and the entropy, at most two fp32 [chunk x vocabulary/TP] tensors live at once, backward recomputes
a chunk's logits and the entropy's gradient only where a loss uses it. `score` computes no entropy
(no caller reads it); training computes it for its metric, without grad unless the loss uses it.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from async_rl.errors import ConfigError, RunError
from async_rl.learner.backend import LossFn, ModelBackend, ParallelInfo, TokenScores
from async_rl.learner.batch.packing import MicroBatch
from async_rl.learner.hf_io import read_model_files
from async_rl.learner.megatron import model as mm
from async_rl.learner.megatron import rotary
from async_rl.learner.megatron.attention import packed_row
from async_rl.learner.megatron.attention import resolve as resolve_attention
from async_rl.learner.megatron.convert import stage_layers
from async_rl.learner.megatron.head import VocabShard, chunked_scores
from async_rl.learner.megatron.routing import RoutingReplay, check_layout, token_routes
from async_rl.learner.model.attention import AttentionLayout, Segments, cumulative, varlen_layout
from async_rl.learner.model.head import keeps_logits
from async_rl.learner.model.head_probe import HeadProbe, agreed_measure, chosen
from async_rl.learner.model.moe import MoeShape, RouterStats
from async_rl.learner.moe_settings import megatron_aux_loss_error
from async_rl.learner.rendezvous import join_group
from async_rl.models.cost import path_of
from async_rl.protocol import TrajectoryGroup


def attention_mask(rows: int, cols: int, position_ids: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Megatron's boolean mask [B, 1, T, T] (True = masked) built on `device` by tensor ops (no host
    sync; only the position ids [B, T] travel, not the mask): causal, and block-diagonal over the
    sequences of a packed row (a sequence starts where its position id is 0)."""
    causal = torch.triu(torch.ones(cols, cols, dtype=torch.bool, device=device), diagonal=1)
    if position_ids is None:
        return causal.expand(rows, 1, cols, cols)
    segment = torch.cumsum((position_ids.to(device, non_blocking=True) == 0).long(), dim=1)  # [B, T]
    across = segment[:, :, None] != segment[:, None, :]
    return (causal[None] | across)[:, None]


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = masked) as SDPA's additive one in `dtype` (-inf where masked), on its device."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))


def cu_seqlens(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Where the sequences of a packed micro-batch [B, T] start and end once its rows are flattened
    into one row of B*T tokens (int32 [n + 1], megatron/TE's `cu_seqlens`), and the longest one. A
    sequence starts where its position id is 0; every row starts one, and a row's unused tail (its
    positions continue) stays with the row's last sequence: after every real token of it, it changes
    nothing that the causal attention lets them see."""
    flat = position_ids.reshape(-1)
    if flat.numel() == 0 or int(flat[0]) != 0:
        raise ValueError("a packed micro-batch's first position id must be 0 (a sequence starts there)")
    starts = torch.nonzero(flat == 0).flatten()
    bounds = torch.cat([starts, torch.tensor([flat.numel()], device=starts.device)]).to(torch.int32)
    return bounds, int((bounds[1:] - bounds[:-1]).max())


def covering_table(mb: MicroBatch) -> Segments | None:
    """The micro-batch's segment table where it covers all of its tokens (O(sequences) numbers, read
    with no pass over the tokens), else None (none, or a micro-batch grown by `pad_to` past it)."""
    seg = mb.segments
    return seg if seg is not None and seg.rows * seg.width == mb.input_ids.numel() else None


def packed_bounds(mb: MicroBatch) -> tuple[torch.Tensor, int]:
    """`cu_seqlens` of a packed micro-batch without shared prompts: from its covering segment table,
    else from its position ids."""
    seg = covering_table(mb)
    if seg is not None and not seg.shares_prefixes:
        return cumulative(seg.lengths), seg.max_len
    return cu_seqlens(mb.position_ids)


def thd_params(mb: MicroBatch, device: torch.device) -> object:
    """megatron's `PackedSeqParams` (qkv_format "thd") for a packed micro-batch flattened to one row."""
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds, longest = packed_bounds(mb)
    bounds = bounds.to(device, non_blocking=True)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=longest, max_seqlen_kv=longest
    )


def row_params(mb: MicroBatch, device: torch.device) -> object:
    """`packed_row`'s parameters for a packed micro-batch flattened to one row (the varlen kernel):
    the varlen layout of its segment table where it has one that covers it, shared prompts included
    (built on the device), else the bounds from its position ids (a micro-batch grown by `pad_to`)."""
    seg = covering_table(mb)
    if seg is not None:
        layout = varlen_layout(seg.to(device))
    else:
        bounds, longest = cu_seqlens(mb.position_ids)
        bounds = bounds.to(device, non_blocking=True)
        layout = AttentionLayout("varlen", bounds, bounds, longest, longest)
    return packed_row(layout, mb.input_ids.numel())


def pad_to(mb: MicroBatch, rows: int, cols: int) -> MicroBatch:
    """`mb` grown to [rows, cols] with rows/columns that carry no loss (pipeline stages exchange one
    activation shape per step)."""
    b, t = mb.input_ids.shape
    if (b, t) == (rows, cols):
        return mb

    def grow(x: torch.Tensor | None) -> torch.Tensor | None:
        if x is None:
            return None
        out = torch.zeros(rows, cols, dtype=x.dtype, device=x.device)
        out[:b, :t] = x
        return out

    position_ids = grow(mb.position_ids)
    if position_ids is not None:  # a row's tail continues its positions (no new sequence); new rows too
        position_ids[:b, t:] = torch.arange(t, cols, device=position_ids.device) if t else 0
        position_ids[b:] = torch.arange(cols, device=position_ids.device)
    return MicroBatch(
        grow(mb.input_ids), position_ids, grow(mb.attention_mask), grow(mb.targets), grow(mb.loss_mask),
        grow(mb.behav_logp), grow(mb.advantages), mb.spans, grow(mb.prox_logp), grow(mb.ref_logp),
        grow(mb.cov_select), routes=mb.routes,  # routes grow with `routing.token_routes`
    )


def vocab_parallel_entropy(logits: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    """Entropy of the full next-token distribution from vocab-parallel logits [B, T, V/tp] -> [B, T]
    float32 (max and sums reduced over the TP group; padding columns excluded), differentiable w.r.t.
    the logits (algorithm.entropy_coef): the sums are reduced by Megatron's reduce-from-TP-region
    (all-reduce forward, identity backward: every TP rank holds the same loss)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    x = logits.float() / temperature
    per_rank = x.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * per_rank
    if start + per_rank > vocab_size:
        x = x.masked_fill(torch.arange(start, start + per_rank, device=x.device) >= vocab_size, float("-inf"))
    group = parallel_state.get_tensor_model_parallel_group()
    # The entropy does not depend on the shift m: a constant here, and the gradient stays exact.
    m = x.detach().max(dim=-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(x - m[..., None])
    both = torch.stack([e.sum(dim=-1), (e * torch.nan_to_num(x, neginf=0.0)).sum(dim=-1)])
    both = reduce_from_tensor_model_parallel_region(both)
    z, s = both[0], both[1]
    return torch.log(z) + m - s / z


def _distributed_optimizers(opt) -> list:
    """The DistributedOptimizers inside megatron's (chained) optimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(opt, "chained_optimizers", [opt])
    return [o for o in inner if isinstance(o, DistributedOptimizer)]


def parameter_state(opt) -> list[dict]:
    """This rank's shard of the distributed optimizer's per-parameter state (fp32 main weights and
    Adam's moments, and `step` under torch's Adam), which its `state_dict` leaves out. Saved per
    rank, copied off the live buffers: a resume with the same layout reads its own shard back.

    Not megatron's `save_parameter_state`/`load_parameter_state`: in 0.16.1 the load copies into
    every state key, and torch's Adam (no Apex/TE) has a `step` that the gathered file lacks
    (KeyError)."""
    out = []
    for o in _distributed_optimizers(opt):
        state = o.get_parameter_state_dp_reshardable()  # views of the live state, no communication
        for buffers in (v for k, v in state.items() if isinstance(k, int)):
            for buckets in buffers.values():
                for bucket in buckets:
                    for i, tensors in enumerate(bucket):
                        bucket[i] = {
                            k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                            for k, v in tensors.items()
                        } | {"padding": False}  # the field megatron's loader filters on
        out.append(state)
    return out


def load_parameter_state(opt, states: list[dict]) -> None:
    """Inverse of `parameter_state`, after `opt.load_state_dict` (which allocates the moments).

    Under torch's Adam, megatron 0.16.1's `load_state_dict` gives every parameter one shared `step`
    tensor, which each later step would then advance once per parameter (wrong bias correction):
    each parameter gets its own copy back."""
    optimizers = _distributed_optimizers(opt)
    if len(states) != len(optimizers):
        raise RunError(f"megatron checkpoint: {len(states)} parameter states for {len(optimizers)} optimizers")
    with torch.no_grad():  # fp32 main weights are views of the model's parameters
        for o, state in zip(optimizers, states, strict=True):
            o.load_parameter_state_from_dp_reshardable(state)
            for per_param in o.optimizer.state.values():
                if isinstance(per_param.get("step"), torch.Tensor):
                    per_param["step"] = per_param["step"].clone()


class MegatronBackend(ModelBackend):
    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        master: str,
        rendezvous_store: dist.TCPStore | None = None,
        tensor_parallel_size: int,
        pipeline_parallel_size: int,
        dtype: str,
        lr: float,
        weight_decay: float,
        max_grad_norm: float,
        distributed_optimizer: bool,
        transformer_engine: str,
        device: str,
        seed: int,
        logprob_chunk_tokens: int = 1024,
        activation_checkpointing: bool = False,
        micro_batch_tokens: int = 0,
        row_tokens: int = 0,
        attention: str = "auto",
        head_kernel: str = "auto",
        keep_logits: bool | str = "auto",
        expert_parallel_size: int = 1,
        routing_replay: str = "auto",
        moe_aux_loss_coef: float = 0.0,
    ) -> None:
        """`micro_batch_tokens` and `row_tokens` (the widest row a micro-batch can have) size the
        start-up line without Transformer Engine (`megatron.memory`); they change nothing else.
        `attention` (learner.megatron.attention): the local spec's core attention (`megatron.attention`).
        `head_kernel` (learner.head_kernel): the chunked head's per-chunk kernel, decided in `setup` (auto on
        CUDA with one model-parallel rank: measured, `head_probe`; else compiled on CUDA, eager on CPU).
        `keep_logits` (learner.logprob_keep_logits): the chunked head keeps its logits for the backward.
        `expert_parallel_size` (learner.megatron.expert_model_parallel_size), `routing_replay`
        (learner.routing_replay) and `moe_aux_loss_coef` (learner.moe_aux_loss_coef, refused above 0):
        MoE models (`megatron.routing`)."""
        self.rank, self.world_size, self.master = rank, world_size, master
        self.rendezvous_store = rendezvous_store  # rank 0's store at `master`, or None (`rendezvous.join_group`)
        self.tp, self.pp, self.ep = tensor_parallel_size, pipeline_parallel_size, expert_parallel_size
        self.routing_setting = routing_replay
        self.moe_aux_loss_coef = moe_aux_loss_coef
        self.routing: RoutingReplay | None = None  # MoE models: the routers' replay and counts
        self.replays_routes = False  # MoE models with learner.routing_replay on/auto: routed tokens run their routes
        self.dtype = getattr(torch, dtype)
        self.lr, self.weight_decay, self.max_grad_norm = lr, weight_decay, max_grad_norm
        self.distributed_optimizer = distributed_optimizer
        self.transformer_engine = transformer_engine
        self.attention_setting = attention
        self.on_cpu = device == "cpu"
        self.seed = seed
        self.chunk = logprob_chunk_tokens
        self.head_setting = head_kernel
        self.head_probe: HeadProbe | None = None  # auto on CUDA, one model-parallel rank: what was measured
        self.keeps_logits = bool(logprob_chunk_tokens) and keeps_logits(keep_logits, "cpu" if self.on_cpu else "cuda")
        self.recompute = activation_checkpointing
        self.micro_batch_tokens, self.row_tokens = micro_batch_tokens, row_tokens
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._joined: RouterStats | None = None  # several pipeline stages: the last gradient pass's routing

    # ---- setup ------------------------------------------------------------------------------------

    def setup(self, model_dir: str) -> int:
        from megatron.core import parallel_state, tensor_parallel

        from async_rl.learner.megatron.learner import MegatronPolicy, use_transformer_engine

        te_spec = use_transformer_engine(self.transformer_engine) and not self.on_cpu
        try:  # TE brings its own attention; without it, the local spec's core attention
            kernel = "te" if te_spec else resolve_attention(self.attention_setting, "cpu" if self.on_cpu else "cuda", self.dtype)
        except ValueError as e:
            raise RunError(str(e)) from None
        distributed = self.distributed_optimizer and not self.on_cpu  # DP=1 on CPU: nothing to shard
        if self.on_cpu:
            from async_rl.learner.megatron import cpu as megatron_cpu

            megatron_cpu.check_config(dtype=self.dtype, distributed_optimizer=False, te_spec=te_spec)
            megatron_cpu.enable()
        elif not torch.cuda.is_available():
            raise RunError("learner.device=cuda but this rank sees no CUDA device")
        else:
            torch.cuda.set_device(0)  # Ray gives each rank one visible GPU
        join_group("gloo" if self.on_cpu else "nccl", self.master, self.rank, self.world_size, self.rendezvous_store)
        # MoE: EP ranks hold their experts whole (expert TP 1); without EP the experts split over TP
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
            expert_model_parallel_size=self.ep, expert_tensor_parallel_size=self.tp if self.ep == 1 else 1,
        )
        if not self.on_cpu:
            tensor_parallel.model_parallel_cuda_manual_seed(self.seed)
        torch.manual_seed(self.seed)
        self._model_files = read_model_files(Path(model_dir))  # config + tokenizer for checkpoints
        self.arch = mm.load_arch(model_dir)
        self.te_spec = te_spec
        self.sharded_optimizer = distributed
        self.attention = kernel
        self.attention_path = "flash" if te_spec else path_of(kernel, "cpu" if self.on_cpu else "cuda")
        # how a packed micro-batch goes in: THD to TE's attention, one row with its bounds to varlen,
        # else rows with a block-diagonal mask (megatron's local attention refuses packed params)
        self.packed_as: Literal["thd", "row", "mask"] = "thd" if te_spec else "row" if kernel == "varlen" else "mask"
        self.policy = MegatronPolicy(
            self.arch,
            mm.SafetensorsCheckpoint(model_dir),
            dtype=self.dtype,
            lr=self.lr,
            weight_decay=self.weight_decay,
            max_grad_norm=self.max_grad_norm,
            distributed_optimizer=distributed,
            te_spec=te_spec,
            cpu_init=self.on_cpu,
            recompute=self.recompute,
            attention="local" if te_spec else kernel,
        )
        self.device = self.policy.device
        # the varlen row rotates each token by its position id (`megatron.rotary`); megatron's own
        # rotary runs unchanged for every other layout
        self.rotary = rotary.install(self._gpt, self.arch.max_position_embeddings)
        self._setup_routing(parallel_state.get_pipeline_model_parallel_rank())
        first_stage = parallel_state.is_pipeline_first_stage()
        self.info = ParallelInfo(
            rank=self.rank,
            world_size=self.world_size,
            dp_rank=parallel_state.get_data_parallel_rank(),
            dp_size=parallel_state.get_data_parallel_world_size(),
            fetches_batch=parallel_state.get_tensor_model_parallel_rank() == 0 and first_stage,
            has_outputs=parallel_state.is_pipeline_last_stage(),
            counts_samples=parallel_state.get_tensor_model_parallel_rank() == 0 and first_stage,
        )
        self.head_probe = self._probe_head()
        self.head_kernel, self.fused_head = chosen(self.head_probe, self.head_setting, "cpu" if self.on_cpu else "cuda")
        self.gather_weights()  # rank 0 serves the sync manifest from the start
        params = sum(math.prod(shape) for shape in mm.hf_param_shapes(self.arch, 1, 0).values())
        # the estimate counts a dense MLP's saved tensors; an MoE layer's (permuted tokens, k experts'
        # intermediates per token, the dispatcher's buffers) are not modelled yet: no line rather than a wrong one
        if not self.on_cpu and not te_spec and self.rank == 0 and not self.arch.is_moe:
            print(self._local_spec_line(params), flush=True)
        return params

    def _setup_routing(self, stage: int) -> None:
        """learner.routing_replay for this model: the replay on the routers of an MoE model; refused in
        one line on a dense one, and where a recompute would replay another micro-batch's routes."""
        if not self.arch.is_moe:
            if self.routing_setting == "on":
                raise RunError(f"learner.routing_replay=on needs a mixture-of-experts model, not the dense "
                               f"{self.arch.model_type}")
            return
        if why := megatron_aux_loss_error(self.moe_aux_loss_coef):
            raise RunError(why)
        self.moe = MoeShape(layers=self.arch.num_layers, experts=self.arch.num_experts, top_k=self.arch.moe_top_k)
        self.replays_routes = self.routing_setting != "off"
        try:
            check_layout(self.pp, self.recompute, self.replays_routes)
        except ConfigError as e:
            raise RunError(str(e)) from None
        # every layer is an MoE layer (`convert.arch_from_hf_config`): the stage's first is its first layer
        self.routing = RoutingReplay.install(self._gpt, stage_layers(self.arch.num_layers, self.pp, stage)[0], self.pp)

    def _routes(self, mb: MicroBatch, rows: int, cols: int, one_row: bool) -> torch.Tensor | None:
        """The micro-batch's routes in the order megatron's routers see its tokens (`routing.token_routes`),
        checked against the model in one line; None without routes."""
        if mb.routes is None:
            return None
        want = (self.arch.num_layers, self.arch.moe_top_k)
        fits = mb.routes.shape[0] <= rows and mb.routes.shape[1] <= cols  # `pad_to` grows the tokens, not the routes
        if tuple(mb.routes.shape[2:]) != want or mb.routes.dim() != 4 or not fits:
            raise RunError(f"megatron routing replay: routes of shape {tuple(mb.routes.shape)} for a micro-batch of "
                           f"{tuple(mb.input_ids.shape)} tokens and a model of {want[0]} MoE layers, top-{want[1]}")
        return token_routes(mb.routes.to(self.device, non_blocking=True), rows, cols, one_row)

    def _probe_head(self) -> HeadProbe | None:
        """learner.head_kernel auto on CUDA where one model-parallel rank holds the whole output layer
        (TP = PP = 1: its chunks run the torch head's kernels, `megatron.head`): the kernels timed on it
        (`head_probe`), agreed over the data-parallel ranks, stated by rank 0. None elsewhere: auto is
        compiled (the vocabulary-shard kernels have no Triton form)."""
        if self.head_setting != "auto" or self.on_cpu or not self.chunk or self.tp * self.pp != 1:
            return None
        gpt = self._gpt
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else gpt.output_layer.weight
        return agreed_measure(weight[: self.arch.vocab_size], self.chunk, weight.dtype,
                              lambda t: self.all_reduce(t, "max"), self.rank == 0)

    def _local_spec_line(self, params: int) -> str:
        """What megatron's local spec costs on this GPU with its attention kernel (see `megatron.memory`),
        in one line."""
        from async_rl.learner.megatron import memory
        from async_rl.learner.megatron.convert import padded_vocab_size

        shape = memory.RankShape(
            layers=self.arch.num_layers, hidden=self.arch.hidden_size, ffn=self.arch.ffn_hidden_size,
            heads=self.arch.num_heads, vocab=padded_vocab_size(self.arch.vocab_size, self.tp), params=params,
            tp=self.tp, pp=self.pp, dp=self.info.dp_size, dtype_bytes=self.dtype.itemsize,
            distributed_optimizer=self.sharded_optimizer, recompute=self.recompute, chunk=self.chunk,
            attention=self.attention, keep_logits=self.keeps_logits,
        )
        free, _ = torch.cuda.mem_get_info()
        capacity = free + torch.cuda.memory_reserved()  # what this process may hold: ours and what is free
        rows = self.row_tokens or self.micro_batch_tokens or self.arch.max_position_embeddings
        return memory.local_spec_line(shape, self.micro_batch_tokens, rows, capacity)

    # ---- forward and backward ---------------------------------------------------------------------

    def _run(self, mbs: list[MicroBatch], temperature: float, forward_only: bool, on_scores) -> None:
        """megatron's schedule over `mbs`; on output ranks `on_scores(i, out, mb, as_rows)` returns
        the loss, `out` being the last stage's vocab-parallel logits, or its final hidden states with
        the chunked head (`_scores` tells them apart by `self.chunk`); `as_rows` maps a batch-first
        tensor of the model's layout to the micro-batch's."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        shape = (max(m.input_ids.shape[0] for m in mbs), max(m.input_ids.shape[1] for m in mbs))
        sized = [pad_to(m, *shape) for m in mbs] if self.pp > 1 else mbs
        items = iter(list(enumerate(sized)))
        dev = self.device

        # Packed micro-batches go to TE's or the varlen attention as one row of tokens with their
        # cu_seqlens (see the module docstring); a step's micro-batches are all packed or all padded.
        layout = self.packed_as if sized[0].position_ids is not None else "mask"
        one_row = layout != "mask"  # the schedule's shapes; a padded micro-batch among them (a rank's
        # dummy, `driver._micro_batches`) still runs as rows

        def forward_step(data_iterator, model):
            i, mb = next(data_iterator)
            ids = mb.input_ids.to(dev)
            rows, cols = ids.shape
            packed, at = None, contextlib.nullcontext()
            if one_row and mb.position_ids is not None:
                ids = ids.reshape(1, rows * cols)
                packed, mask = (thd_params if layout == "thd" else row_params)(mb, dev), None
                if layout == "row":
                    at = self.rotary.at(mb.position_ids.to(dev, non_blocking=True).reshape(-1))
            elif self.on_cpu or mb.position_ids is not None:
                mask = attention_mask(rows, cols, mb.position_ids, dev)
                if self.attention == "sdpa":  # additive, built once: every layer's SDPA reads it as is
                    mask = additive(mask, self.dtype)
            else:
                mask = None  # megatron's own causal mask (fused kernels)
            positions = torch.arange(ids.shape[1], device=dev).unsqueeze(0).expand(ids.shape[0], -1)
            feeding = contextlib.nullcontext()
            if self.routing is not None:  # MoE: this micro-batch's routes, or the live router
                routes = self._routes(mb, rows, cols, one_row and mb.position_ids is not None)
                feeding = self.routing.feeding(routes, self.replays_routes, count=bool(mbs[i].spans))
            with at, feeding:
                output = model(ids, positions, mask, packed_seq_params=packed)

            def as_rows(x: torch.Tensor) -> torch.Tensor:
                """A batch-first tensor of the model's layout [1, B*T, ...] (THD) or [B, T, ...]
                as this micro-batch's [B, T, ...], cut back to its size before `pad_to`."""
                b, t = mbs[i].input_ids.shape
                return x.reshape(rows, cols, *x.shape[2:])[:b, :t]

            def loss_func(logits: torch.Tensor):
                return on_scores(i, as_rows(logits), mbs[i].to(dev), as_rows), {}

            return output, loss_func

        if self.routing is not None:
            self.routing.reset()  # the counts are this run's (several stages: its token flags)
        with self._hidden_out(), self._routes_cleared():
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=items,
                model=[self.policy.model],
                num_microbatches=len(sized),
                seq_length=shape[0] * shape[1] if one_row else shape[1],
                micro_batch_size=1 if one_row else shape[0],
                forward_only=forward_only,
            )

    @contextlib.contextmanager
    def _routes_cleared(self):
        """No replay target outlives a schedule's run (the last micro-batch's stays for its recompute)."""
        try:
            yield
        finally:
            if self.routing is not None:
                self.routing.clear()

    def score_routing(self, mb: MicroBatch, temperature: float, replay: bool) -> TokenScores | None:
        """`score` with routing replay on or off whatever learner.routing_replay says (the mismatch
        probe: the engine's log-probs against the learner's, both ways)."""
        if self.routing is None:
            raise RunError("megatron: score_routing on a dense model")
        setting, self.replays_routes = self.replays_routes, replay
        try:
            return self.score(mb, temperature)
        finally:
            self.replays_routes = setting

    @property
    def takes_block_masks(self) -> bool:
        """Shared prompts where a packed micro-batch goes as the varlen row (the attention reads each
        suffix's prefix through the layout's key index, RoPE each token's position id), on one pipeline
        stage: `pad_to` grows the rows past their segment table."""
        return self.packed_as == "row" and self.pp == 1

    @property
    def _gpt(self):
        """This rank's GPTModel inside megatron's wrappers (DDP, Float16Module)."""
        from megatron.core.models.gpt import GPTModel

        return next(m for m in self.policy.model.modules() if isinstance(m, GPTModel))

    @contextlib.contextmanager
    def _hidden_out(self):
        """With the chunked head: the last stage's forward returns its final hidden states in place
        of logits (its output layer is the identity meanwhile); `_head_scores` applies it."""
        layer = getattr(self._gpt, "output_layer", None)
        if not self.chunk or layer is None:
            yield
            return
        layer.forward = lambda hidden_states, weight=None, runtime_gather_output=None: (hidden_states, None)
        try:
            yield
        finally:
            del layer.forward  # the class's forward again

    def _head_scores(
        self, hidden: torch.Tensor, mb: MicroBatch, temperature: float, idx: torch.Tensor, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs (with grad) and, when `with_entropy`, entropies [B, T] (zeros otherwise) from the
        final hidden states [B, T, H] at the flat positions `idx` only (0 elsewhere), through the
        vocab-parallel output layer a chunk at a time (`megatron.head`)."""
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        gpt = self._gpt
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else gpt.output_layer.weight
        b, t, h = hidden.shape
        flat = hidden.reshape(b * t, h).index_select(0, idx)
        targets = mb.targets.reshape(-1).index_select(0, idx)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
        shard = VocabShard.of(self.arch.vocab_size, weight.shape[0], parallel_state.get_tensor_model_parallel_rank(), group)
        if tp > 1:  # the hidden states' gradient is a sum over the vocabulary shards (all-reduce in backward)
            flat = copy_to_tensor_model_parallel_region(flat)
        # Every TP rank runs the same chunks (the same positions): their collectives line up.
        logp, entropy = chunked_scores(flat, weight, targets, temperature, self.chunk, shard, with_entropy,
                                       self.fused_head, self.keeps_logits)
        zeros = torch.zeros(b * t, dtype=torch.float32, device=hidden.device)
        return zeros.index_copy(0, idx, logp).reshape(b, t), zeros.index_copy(0, idx, entropy).reshape(b, t)

    def _scores(
        self, logits: torch.Tensor, mb: MicroBatch, temperature: float, idx: torch.Tensor, with_entropy: bool
    ) -> TokenScores:
        """Scores from what the last stage returned: its final hidden states with the chunked head
        (at the flat positions `idx`: an index built on the host, so no `nonzero` syncs per
        micro-batch), vocab-parallel logits otherwise (every position). The entropy (None unless
        `with_entropy`) is what training logs and what `algorithm.entropy_coef` trains on; the
        scoring passes use none."""
        if self.chunk:
            logp, entropy = self._head_scores(logits, mb, temperature, idx, with_entropy)
            return TokenScores(logp=logp, entropy=entropy if with_entropy else None)
        logp = mm.vocab_parallel_logprobs(logits, mb.targets, self.arch.vocab_size, temperature)
        entropy = vocab_parallel_entropy(logits, self.arch.vocab_size, temperature) if with_entropy else None
        return TokenScores(logp=logp, entropy=entropy)

    def score(
        self, mb: MicroBatch, temperature: float, *, hidden: bool = False, head: bool = True
    ) -> TokenScores | None:
        # `head=False` (ppo's critic reads the hidden states only): no log-probs. With the chunked head
        # the output layer is then never applied; without it GPTModel's last stage applies it anyway.
        out: list[TokenScores] = []
        # The last hidden states (ppo's critic): the final layernorm's output on the last stage, what
        # the output layer reads and HF's `hidden_states[-1]`. Without sequence parallelism it is
        # whole on every TP rank; [S, B, H] in megatron's layout.
        final: list[torch.Tensor] = []
        norm = self.policy.model.module.decoder.final_layernorm if hidden else None
        handle = norm.register_forward_hook(lambda _m, _i, o: final.append(o)) if norm is not None else None

        span_index = mb.span_index().to(self.device, non_blocking=True)  # from the spans: no data-dependent op

        def keep(i: int, logits: torch.Tensor, m: MicroBatch, as_rows) -> torch.Tensor:
            h = as_rows(final[-1].transpose(0, 1)).float() if hidden else None
            if not head:
                out.append(TokenScores(logp=None, entropy=None, hidden=h))
                return torch.zeros((), device=logits.device)
            s = self._scores(logits, m, temperature, span_index, with_entropy=False)
            out.append(TokenScores(logp=s.logp.detach(), entropy=None, hidden=h))
            return s.logp.sum()

        try:
            with torch.no_grad():
                self._run([mb], temperature, True, keep)
        finally:
            if handle is not None:
                handle.remove()
        if self.pp == 1:
            return out[0] if out else None
        return self._from_last_stage(out[0] if out else None, mb, hidden, head)

    def _from_last_stage(self, scores: TokenScores | None, mb: MicroBatch, hidden: bool, head: bool) -> TokenScores:
        """Every pipeline stage gets the last stage's scores (and hidden states): the controller reads
        the mismatch probe and compute_logprobs from global rank 0, the first stage, and ppo's critic
        trains on every rank alike."""
        from megatron.core import parallel_state

        group = parallel_state.get_pipeline_model_parallel_group()
        src = dist.get_process_group_ranks(group)[-1]
        logp = None
        if head:
            logp = torch.zeros(*mb.input_ids.shape, dtype=torch.float32, device=self.device)
            if scores is not None:
                logp.copy_(scores.logp)
            dist.broadcast(logp, src=src, group=group)
        h = None
        if hidden:
            h = torch.zeros(*mb.input_ids.shape, self.arch.hidden_size, dtype=torch.float32, device=self.device)
            if scores is not None:
                h.copy_(scores.hidden)
            dist.broadcast(h, src=src, group=group)
        return TokenScores(logp=logp, entropy=None, hidden=h)

    def forward_backward(self, mbs: list[MicroBatch], temperature: float, loss_fn: LossFn) -> None:
        # megatron divides each micro-batch's loss by their count and its DDP averages gradients
        # over DP ranks: scale back so the gradient is the SUM the interface promises.
        scale = len(mbs) * self.info.dp_size

        # the loss positions of each micro-batch, indexed on the host (the packing's `loss_index`, or
        # the host mask's nonzero for padded rows): the device sees no data-dependent op
        index = [mb.head_index().to(self.device, non_blocking=True) for mb in mbs]

        # One pipeline stage: the loss of a micro-batch follows its forward (its recompute counts nothing),
        # so the routers' counts since the last `take` are that forward's. With several stages a stage
        # holds its own layers' counts only: they are joined over the stages after the run (`router_stats`).
        routing = self.routing if self.pp == 1 else None

        def loss(i: int, logits: torch.Tensor, m: MicroBatch, _as_rows) -> torch.Tensor:
            # the entropy is always logged; it carries a gradient only where the loss uses it
            scores = self._scores(logits, m, temperature, index[i], with_entropy=True)
            if routing is not None:
                scores.router = routing.take()
            return loss_fn(i, scores) * scale

        self._snapshot = None
        self._joined = None
        self._run(mbs, temperature, False, loss)
        if self.routing is not None and self.pp > 1:
            from megatron.core import parallel_state

            self._joined = self.routing.joined_stats(
                self.arch.num_layers, parallel_state.get_pipeline_model_parallel_group())

    def router_stats(self) -> RouterStats | None:
        """With several pipeline stages: the last `forward_backward`'s routing statistics over every
        stage's layers, the same on each stage (with one, they came per micro-batch)."""
        return self._joined

    def optimizer_step(self, lr: float, max_grad_norm: float) -> float:
        opt = self.policy.optimizer
        # megatron checks for inf/NaN only under fp16's loss scaler; in bf16 and fp32 its step applies
        # a NaN gradient (and its clip, `coeff < 1`, is false for a NaN norm). Check the reduced grad
        # buffers ourselves, the flag reduced over every rank (TP, PP and DP peers skip together).
        # Under a loss scaler its own check must see the overflow (it backs the scale off).
        if not self._loss_scaled() and not self._gradients_finite():
            self.drop_gradients()
            return math.nan
        for group in opt.param_groups:
            group["lr"] = lr
        opt.config.clip_grad = max_grad_norm
        ok, grad_norm, _ = opt.step()
        self.drop_gradients()
        if not ok:  # fp16: the loss scaler found inf/NaN (every rank agrees) and backed off; no step
            return math.nan
        self._snapshot = None
        return float(grad_norm if grad_norm is not None else 0.0)

    def _loss_scaled(self) -> bool:
        opt = self.policy.optimizer
        return any(getattr(o, "grad_scaler", None) is not None for o in getattr(opt, "chained_optimizers", [opt]))

    def _gradients_finite(self) -> bool:
        """No inf/NaN in this rank's gradient buffers, on every rank of the learner group (collective).
        A distributed optimizer's rank holds its reduced shard and its own unreduced rest: a non-finite
        value anywhere in the reduced gradient is non-finite in some rank's buffer."""
        ddp = self.policy.model
        bad = torch.zeros(1, device=self.device)
        for buffer in ddp.buffers + ddp.expert_parallel_buffers:
            bad += (~torch.isfinite(buffer.grad_data)).any().float()
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return float(bad[0]) == 0.0

    def drop_gradients(self) -> None:
        self.policy.model.zero_grad_buffer()
        self.policy.optimizer.zero_grad()

    def all_reduce(self, x: torch.Tensor, op: Literal["sum", "max"] = "sum") -> torch.Tensor:
        from megatron.core import parallel_state

        if self.info.dp_size == 1:
            return x
        y = x.to(self.device).clone()
        dist.all_reduce(
            y, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX,
            group=parallel_state.get_data_parallel_group(),
        )
        return y.to(x.device)

    def share_shard(self, groups: list[TrajectoryGroup] | None) -> list[TrajectoryGroup]:
        from megatron.core import parallel_state

        if self.tp * self.pp == 1:
            assert groups is not None
            return groups
        group = parallel_state.get_model_parallel_group()
        box = [groups]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group, device=self.device)
        return box[0]

    def share_outputs(self, values: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state

        if self.pp == 1:
            return values
        group = parallel_state.get_pipeline_model_parallel_group()
        out = values.to(self.device, torch.float64).clone()
        dist.broadcast(out, src=dist.get_process_group_ranks(group)[-1], group=group)
        return out.to(values.device)

    # ---- weights ----------------------------------------------------------------------------------

    def gather_weights(self) -> None:
        if self._snapshot is None:
            self._snapshot = self.policy.hf_state_dict() or {}  # collective; full only on rank 0

    def weights_gathered(self) -> bool:
        return self._snapshot is not None

    def hf_weights(self) -> dict[str, torch.Tensor]:
        if not self._snapshot:
            raise RunError("megatron: hf_weights on a rank without gathered weights (call gather_weights first)")
        return self._snapshot

    # ---- checkpoints --------------------------------------------------------------------------------

    def save(self, directory: str) -> None:
        """`model/`: an HF folder (rank 0); each rank's optimizer state, and with the distributed
        optimizer each rank's parameter state (see `parameter_state`)."""
        from async_rl.learner.base import checkpoint_model_dir
        from async_rl.learner.hf_io import write_hf_folder

        self.gather_weights()
        root = Path(directory)
        if self.rank == 0:
            write_hf_folder(checkpoint_model_dir(root), self._model_files, self.hf_weights())
        opt = self.policy.optimizer
        torch.save(opt.state_dict(), root / f"megatron_optimizer_rank{self.rank}.pt")
        if self.sharded_optimizer:
            torch.save(parameter_state(opt), root / f"megatron_parameter_state_rank{self.rank}.pt")
        dist.barrier()

    def load(self, directory: str) -> None:
        from async_rl.learner.base import checkpoint_model_dir

        root = Path(directory)
        mm.load_hf_weights(
            self.policy.model, mm.SafetensorsCheckpoint(checkpoint_model_dir(root)), self.arch, self.te_spec
        )
        # Our own files (optimizer state): not an untrusted download.
        def read(name: str):
            return torch.load(root / f"{name}_rank{self.rank}.pt", weights_only=False, map_location=self.device)

        opt = self.policy.optimizer
        opt.load_state_dict(read("megatron_optimizer"))  # the distributed optimizer's moments: empty
        if self.sharded_optimizer:
            load_parameter_state(opt, read("megatron_parameter_state"))
        self._snapshot = None
        self.gather_weights()

    def shutdown(self) -> None:
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except ImportError:
            pass
        if dist.is_initialized():
            dist.destroy_process_group()
