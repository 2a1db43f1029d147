"""Megatron-core GPTModel for a HF Llama/Qwen2/Qwen3 checkpoint, dense or a mixture of experts
(Qwen3-MoE, Qwen2-MoE: megatron's MoELayer): build, load, per-token log-probs, export.

Everything here imports megatron-core inside the functions that need it, so importing this module
is cheap and works where megatron-core is not installed. `parallel_state` must be initialised
(`initialize_model_parallel`) before `build_model`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from async_rl.learner.megatron import convert as mcv
from async_rl.learner.megatron.convert import HFArch


def load_arch(model_dir: str | Path) -> HFArch:
    from transformers import AutoConfig

    return mcv.arch_from_hf_config(AutoConfig.from_pretrained(str(model_dir)))


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def transformer_config(
    arch: HFArch, dtype: torch.dtype, cpu_init: bool, pipeline: int, recompute: bool = False,
    fused_swiglu: bool | None = None, te_spec: bool = False,
) -> Any:
    """Megatron's TransformerConfig for `arch`: RMSNorm, SwiGLU, GQA, RoPE, no dropout, no fusions
    that need Apex/TE kernels (Transformer Engine, when used, brings its own). `cpu_init`: the model
    is built on the CPU and stays there (see megatron.cpu). `recompute` (learner.activation_checkpointing):
    full recompute of every layer, one layer per checkpoint, so only each layer's input is kept.
    `fused_swiglu` (default: off the CPU): megatron's SwiGLU fusion (`bias_activation_fusion`), one
    `torch.compile`d kernel forward and one backward (megatron.core.jit) that keep only the MLP's
    [tokens, 2 x ffn] input, where the unfused path runs chunk, silu, product and their backwards
    (about 0.3 s of the 0.5B step's 2.25 s of CUDA time on 2026-11-28). The CPU keeps it off: every
    process would pay inductor's C++ build (tests spawn many); the two are equal (test_megatron_model).
    A mixture of experts gets megatron's MoE fields (`moe_config`; `te_spec`: its experts are TE's
    grouped GEMM)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        **moe_config(arch, te_spec, on_cpu=cpu_init),
        qk_layernorm=arch.qk_norm,
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # RL compares the learner's log-probs with vLLM's token by token: keep the softmax in fp32.
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=not cpu_init if fused_swiglu is None else fused_swiglu,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype if pipeline > 1 else None,
        use_cpu_initialization=cpu_init,
        # A model initialised on the CPU trains there (megatron.cpu): gloo has no batched p2p, and the
        # batched path ends in torch.cuda.synchronize.
        batch_p2p_comm=not cpu_init,
        tensor_model_parallel_size=_tp_size(),
        pipeline_model_parallel_size=pipeline,
        **({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1} if recompute else {}),
    )


def moe_config(arch: HFArch, te_spec: bool, on_cpu: bool) -> dict[str, Any]:
    """TransformerConfig's MoE fields for `arch` (none for a dense model). The router is HF's: a
    softmax over every expert's logit in fp32, the top-k of it; Qwen3-MoE's norm_topk_prob
    renormalises the k probabilities to sum 1, which is megatron's top-k of the logits followed by a
    softmax over those k (`moe_router_pre_softmax` off); without it (Qwen2-MoE) the k probabilities
    are the full softmax's (pre-softmax on). No token dropping, no load-balancing loss, no expert
    bias. Routing replay is built in (`megatron.routing`: a router without a replay target routes
    live). The fused top-k (`moe_router_fusion`) returns before megatron's replay hook, so replay
    would be skipped silently: it stays off (`megatron.routing.check_replayable` refuses a model
    where it is on). Experts are megatron's SequentialMLP without Transformer Engine (one GEMM pair
    per local expert), TE's grouped GEMM with it. Expert parallelism: `parallel_state`'s sizes. Token
    dispatch: megatron's all-to-all on CUDA; its all-gather on CPU (the all-to-all dispatcher builds a
    CUDA stream for its device-to-host copies when it is constructed, `token_dispatcher.py:445`, and
    syncs on CUDA events: GPU only)."""
    if not arch.is_moe:
        return {}
    from megatron.core import parallel_state

    return {
        "num_moe_experts": arch.num_experts,
        "moe_ffn_hidden_size": arch.moe_ffn_hidden_size,
        "moe_router_topk": arch.moe_top_k,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not arch.norm_topk_prob,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_router_dtype": "fp32",
        "moe_router_fusion": False,
        "moe_enable_routing_replay": True,
        "moe_token_dispatcher_type": "allgather" if on_cpu else "alltoall",
        "moe_grouped_gemm": te_spec,
        "moe_shared_expert_intermediate_size": arch.shared_expert_ffn or None,
        "moe_shared_expert_gate": arch.shared_expert_ffn > 0,
        "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
        "expert_tensor_parallel_size": parallel_state.get_expert_tensor_parallel_world_size(),
    }


def _tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def build_model(
    arch: HFArch, dtype: torch.dtype, cpu_init: bool, te_spec: bool, recompute: bool = False, attention: str = "local"
) -> Any:
    """This rank's GPTModel (its TP shard of its pipeline stage), randomly initialised."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    mcv.check_parallel_layout(arch, tp, pp, parallel_state.get_expert_model_parallel_world_size(),
                              parallel_state.get_expert_tensor_parallel_world_size())
    config = transformer_config(arch, dtype, cpu_init, pp, recompute, te_spec=te_spec)
    model = GPTModel(
        config=config,
        transformer_layer_spec=decoder_spec(config, te_spec, attention),
        vocab_size=mcv.padded_vocab_size(arch.vocab_size, tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=arch.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
        rope_scaling=arch.rope_scaling_factor > 0,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
        parallel_output=True,  # logits stay vocab-parallel; the loss uses vocab-parallel CE
    )
    cast_parameters(model, dtype)
    if arch.is_moe:
        _router_gemm_without_te()
        if tp > 1:
            _moe_under_tensor_parallelism(model, tp)
    return model


def _moe_under_tensor_parallelism(model: torch.nn.Module, tp: int) -> None:
    """MoE layers with TP > 1 and no sequence parallelism (this backend does not build megatron's).

    Every TP rank holds the whole sequence; megatron's token dispatcher gathers the tokens of the
    TP (and EP) ranks, so each rank's experts see every token once per TP rank, and its combine
    reduce-scatters each rank's own tokens back. The forward is exact (the inference path), but in
    training megatron 0.16.1 refuses it (`MoELayer.forward`: "performance may degrade ... without
    also enabling sequence parallelism"), and the backward gives each expert parameter the sum over
    the TP copies of the same loss: TP times its gradient (the router, on each rank's own copy, is
    not affected). So: the MoE layers run in eval mode (with dropout 0 and no aux loss, z-loss, jitter
    or sinkhorn, `moe_config`, the two modes compute the same) and each expert parameter's gradient is
    divided by TP before it reaches megatron's grad buffer. The cost: the experts' activations and,
    with EP, their FLOPs count each token TP times (sequence parallelism would split them)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for module in model.modules():
        if isinstance(module, MoELayer):
            module.train(False)
    for name, p in parameters_by_name(model).items():
        if mcv.is_expert(name):
            p.register_hook(lambda g: g / tp)


def _router_gemm_without_te() -> None:
    """megatron-core 0.16.1's router gating (`moe_utils.RouterGatingLinearFunction`) tests
    `te_general_gemm is not None`, a name its module binds only where Transformer Engine imports: without
    TE every MoE forward raised NameError. Bound to None there, the gating takes its torch.mm path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every floating-point parameter of `model` in `dtype`, as Transformer Engine's spec builds them
    and as the HF checkpoint and vLLM hold them. Without TE megatron's local spec builds its norms
    with torch's RMSNorm (`WrappedTorchNorm`), which ignores `params_dtype`: fp32 norm weights beside
    bf16 weights. megatron-core 0.16.1's distributed optimizer then puts both dtypes in one parameter
    group (norms and qkv biases share the no-weight-decay group) and keys their state by an index
    that its fp32-first reordering made stale (Megatron-LM #2777): saving reads, and loading writes,
    another parameter's shard ("size of tensor a (256) must match ... (128)"). One dtype keeps every
    group single-dtype; the optimizer's fp32 main weights keep the update's precision, and torch's
    rms_norm computes the statistics in fp32 whatever the weight's dtype."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def check_single_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Refuse, in one line, a model whose parameters are not all `dtype` (the distributed optimizer's
    checkpoints would mix up parameters on the first resume: see `cast_parameters`)."""
    other = sorted({f"{n} ({p.dtype})" for n, p in model.named_parameters() if p.dtype != dtype})
    if other:
        raise RuntimeError(
            f"megatron: {len(other)} parameters are not {dtype} (first: {other[0]}); the distributed "
            "optimizer needs one parameter dtype to checkpoint correctly (Megatron-LM #2777)"
        )


def decoder_spec(config: Any, te_spec: bool, attention: str = "local") -> Any:
    """The decoder block of this pipeline stage: its layers (Transformer Engine's or megatron's local
    modules) and a final norm of the same kind. Given a layer spec alone, megatron 0.16.1 picks the
    final norm by what is importable, whatever the layers use: TE's if installed, else Apex's
    FusedLayerNorm (which asserts on RMSNorm: a build without TE but with Apex failed), else torch's.
    Without TE the final norm here is torch's (`WrappedTorchNorm`, RMSNorm), as in the layers, and
    `attention` other than `local` replaces the local layers' `DotProductAttention` with torch's
    kernels (`megatron.attention`)."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    moe = {"num_experts": config.num_moe_experts, "moe_grouped_gemm": config.moe_grouped_gemm,
           "qk_layernorm": config.qk_layernorm}
    if te_spec:
        from megatron.core.extensions.transformer_engine import TENorm

        layer, norm = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**moe), TENorm
    else:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        layer, norm = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", **moe), WrappedTorchNorm
        if attention != "local":
            from async_rl.learner.megatron.attention import core_attention_class

            layer.submodules.self_attention.submodules.core_attention = core_attention_class()
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=norm)


def parameters_by_name(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Named parameters without wrapper prefixes (Megatron's DDP wraps the model as `module.`)."""
    inner = model
    while hasattr(inner, "module") and isinstance(inner.module, torch.nn.Module):
        inner = inner.module
    return dict(inner.named_parameters())


def load_hf_weights(
    model: torch.nn.Module, hf: Mapping[str, torch.Tensor], arch: HFArch, te_spec: bool
) -> None:
    """Copy this rank's shard of the HF weights into `model`; every parameter must be covered."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    full = mcv.hf_to_megatron_full(hf, arch, tp, pp, stage, te_spec)
    if arch.is_moe:
        ep, ep_rank = parallel_state.get_expert_model_parallel_world_size(), parallel_state.get_expert_model_parallel_rank()
        full = mcv.expert_shard(full, arch, ep, ep_rank, te_spec)
        etp, etp_rank = (parallel_state.get_expert_tensor_parallel_world_size(),
                         parallel_state.get_expert_tensor_parallel_rank())
    params = parameters_by_name(model)
    missing, unused = sorted(set(params) - set(full)), sorted(set(full) - set(params))
    if missing or unused:
        raise RuntimeError(f"HF->Megatron conversion mismatch: missing {missing[:4]}, unused {unused[:4]}")
    with torch.no_grad():
        for name, p in params.items():
            expert = arch.is_moe and mcv.is_expert(name)  # split over the expert tensor-parallel ranks
            part = mcv.shard(full[name], mcv.shard_kind(name), *((etp_rank, etp) if expert else (tp_rank, tp)))
            if part.shape != p.shape:
                raise RuntimeError(f"{name}: converted shard {tuple(part.shape)} != parameter {tuple(p.shape)}")
            p.copy_(part)


class SafetensorsCheckpoint(Mapping[str, torch.Tensor]):
    """A HF safetensors checkpoint read tensor by tensor (a rank loads only what its shard needs)."""

    def __init__(self, model_dir: str | Path) -> None:
        from safetensors import safe_open

        root = Path(model_dir)
        index = root / "model.safetensors.index.json"
        files = (
            sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if index.is_file()
            else ["model.safetensors"]
        )
        self._handles = [safe_open(str(root / f), framework="pt") for f in files]
        self._where = {k: h for h in self._handles for k in h.keys()}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"checkpoint has no tensor '{name}'")
        return self._where[name].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


# ---- forward and log-probs ------------------------------------------------------------------------


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor | None:
    """Megatron's default causal mask is created on 'cuda'; elsewhere pass an explicit one
    (True = masked). Right-padded batches need nothing else: padding only follows real tokens."""
    if device.type == "cuda":
        return None
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def forward_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Vocab-parallel logits [B, T, V/tp] on the last stage (hidden states elsewhere)."""
    b, t = input_ids.shape
    positions = torch.arange(t, device=input_ids.device).unsqueeze(0).expand(b, -1)
    return model(input_ids, positions, causal_mask(t, input_ids.device))


def vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, temperature: float = 1.0
) -> torch.Tensor:
    """log p(target) from vocab-parallel logits [B, T, V/tp] (targets [B, T]) -> [B, T] float32.

    Megatron's vocab-parallel cross entropy reduces max and sum over the TP group, so no rank ever
    holds full-vocabulary logits; logp = -CE. Padding columns (vocab rounded up to a TP multiple) are
    masked out so the distribution is the HF model's. The CE kernel writes into its input: it gets a
    fresh float32 tensor.
    """
    from megatron.core import parallel_state, tensor_parallel

    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    per_rank = x.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * per_rank
    if start + per_rank > vocab_size:
        pad = torch.arange(start, start + per_rank, device=x.device) >= vocab_size
        x = x.masked_fill(pad, float("-inf"))
    elif x.data_ptr() == logits.data_ptr():
        x = x.clone()
    return -tensor_parallel.vocab_parallel_cross_entropy(x, targets)


# ---- export under HF names ------------------------------------------------------------------------


def gathered_stage_tensors(model: torch.nn.Module, arch: HFArch) -> dict[str, torch.Tensor]:
    """This stage's full Megatron tensors: every TP shard all-gathered (collective over the TP group);
    a mixture of experts' experts all-gathered over the expert tensor-parallel group, then over the
    expert-parallel group, under their global expert names."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    out = {}
    for name, p in parameters_by_name(model).items():
        if arch.is_moe and mcv.is_expert(name):
            out.update(_gathered_expert(name, p, arch))
            continue
        out[name] = _tp_gathered(p, mcv.shard_kind(name), tp, group)
    return out


def _tp_gathered(p: torch.Tensor, kind: mcv.ShardKind, size: int, group: Any) -> torch.Tensor:
    if size == 1 or kind is mcv.ShardKind.REPLICATED:
        return p.detach()
    parts = [torch.empty_like(p) for _ in range(size)]
    dist.all_gather(parts, p.detach().contiguous(), group=group)
    return mcv.gather(parts, kind)


def _gathered_expert(name: str, p: torch.Tensor, arch: HFArch) -> dict[str, torch.Tensor]:
    """One local expert parameter of every expert-parallel rank, whole, under its global name
    (collective over the expert tensor-parallel and the expert-parallel groups)."""
    from megatron.core import parallel_state

    etp = parallel_state.get_expert_tensor_parallel_world_size()
    whole = _tp_gathered(p, mcv.shard_kind(name), etp, parallel_state.get_expert_tensor_parallel_group())
    ep = parallel_state.get_expert_model_parallel_world_size()
    if ep == 1:
        return {mcv.expert_global_name(name, arch, 1, 0): whole}
    parts = [torch.empty_like(whole) for _ in range(ep)]
    dist.all_gather(parts, whole.contiguous(), group=parallel_state.get_expert_model_parallel_group())
    return {mcv.expert_global_name(name, arch, ep, r): t for r, t in enumerate(parts)}


def hf_param_shapes(arch: HFArch, pp: int, stage: int) -> dict[str, tuple[int, ...]]:
    """HF names and shapes a pipeline stage exports (what the receiving rank allocates)."""
    h, hd = arch.hidden_size, arch.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    if stage == 0:
        shapes["model.embed_tokens.weight"] = (arch.vocab_size, h)
    for i in mcv.stage_layers(arch.num_layers, pp, stage):
        a = f"model.layers.{i}.self_attn."
        for proj, heads in (("q_proj", arch.num_heads), ("k_proj", arch.num_kv_heads), ("v_proj", arch.num_kv_heads)):
            shapes[a + proj + ".weight"] = (heads * hd, h)
            if arch.qkv_bias:
                shapes[a + proj + ".bias"] = (heads * hd,)
        shapes[a + "o_proj.weight"] = (h, arch.num_heads * hd)
        if arch.qk_norm:
            shapes[a + "q_norm.weight"] = shapes[a + "k_norm.weight"] = (hd,)
        m = f"model.layers.{i}.mlp."
        shapes.update(_moe_shapes(arch, m) if arch.is_moe else {
            m + "gate_proj.weight": (arch.ffn_hidden_size, h),
            m + "up_proj.weight": (arch.ffn_hidden_size, h),
            m + "down_proj.weight": (h, arch.ffn_hidden_size),
        })
        shapes[f"model.layers.{i}.input_layernorm.weight"] = (h,)
        shapes[f"model.layers.{i}.post_attention_layernorm.weight"] = (h,)
    if stage == pp - 1:
        shapes["model.norm.weight"] = (h,)
        if not arch.tie_embeddings:
            shapes["lm_head.weight"] = (arch.vocab_size, h)
    return shapes


def _moe_shapes(arch: HFArch, m: str) -> dict[str, tuple[int, ...]]:
    """One MoE layer's HF shapes under the prefix `m` (its `mlp.`), in the HF model's order."""
    h, e, ffn = arch.hidden_size, arch.num_experts, arch.moe_ffn_hidden_size
    router = {m + "gate.weight": (e, h)}
    experts = {m + "experts.gate_up_proj": (e, 2 * ffn, h), m + "experts.down_proj": (e, h, ffn)}
    shared = {}
    if arch.shared_expert_ffn:
        s = arch.shared_expert_ffn
        shared = {m + "shared_expert.gate_proj.weight": (s, h), m + "shared_expert.up_proj.weight": (s, h),
                  m + "shared_expert.down_proj.weight": (h, s), m + "shared_expert_gate.weight": (1, h)}
    ordered = router | experts if arch.model_type == "qwen2_moe" else experts | router
    return ordered | shared


def hf_state_dict(model: torch.nn.Module, arch: HFArch, te_spec: bool, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """The full model under HF names on global rank `dst` (None elsewhere). Collective: every rank of
    the model-parallel group that holds `dst` calls it (TP all-gathers, then each later pipeline
    stage's TP rank 0 sends its tensors to `dst`, in the order of `hf_param_shapes`)."""
    from megatron.core import parallel_state

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    mine = dict(mcv.megatron_full_to_hf(gathered_stage_tensors(model, arch), arch, pp, stage, te_spec))
    me = dist.get_rank() if dist.is_initialized() else 0
    if pp == 1:
        return mine if me == dst else None
    pp_ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    if dst not in pp_ranks:
        return None  # another data-parallel replica (or TP rank) holds what `dst` receives
    out: dict[str, torch.Tensor] | None = dict(mine) if me == dst else None
    for s in range(1, pp):
        src = pp_ranks[s]
        if me == src and tp_rank == 0:
            for name in hf_param_shapes(arch, pp, s):
                dist.send(mine[name].contiguous(), dst)
        elif me == dst:
            like = next(iter(mine.values()))
            for name, shape in hf_param_shapes(arch, pp, s).items():
                t = torch.empty(shape, dtype=like.dtype, device=like.device)
                dist.recv(t, src)
                out[name] = t
    if out is None:
        return None
    order = [n for s in range(pp) for n in hf_param_shapes(arch, pp, s)]
    return {n: out[n] for n in order}
