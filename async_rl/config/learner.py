"""The learner: backend, parallelism, micro-batches, optimizer, LoRA, Megatron."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from async_rl.config.base import DEVICE_AUTO, Device, _f, _Section


class MegatronConfig(_Section):
    tensor_parallel_size: Annotated[int, _f("megatron: tensor-parallel ranks per model replica", ge=1)] = 1
    pipeline_parallel_size: Annotated[int, _f("megatron: pipeline stages per model replica", ge=1)] = 1
    expert_model_parallel_size: Annotated[
        int,
        _f("megatron, MoE models: expert-parallel ranks; each holds num_experts / this many experts whole (expert "
           "tensor parallelism 1; at 1 the experts split over the tensor-parallel ranks instead). Drawn from the "
           "tensor x data-parallel ranks of a pipeline stage (megatron's expert grid): learner.world_size / "
           "pipeline_parallel_size must be a multiple of it. Tokens reach their experts by megatron's all-to-all "
           "dispatcher on CUDA, its all-gather one on CPU (learner/megatron/model.py)", ge=1),
    ] = 1
    distributed_optimizer: Annotated[
        bool, _f("megatron: shard optimizer state over data-parallel ranks (megatron DistributedOptimizer)")
    ] = True
    transformer_engine: Annotated[
        Literal["auto", "on", "off"],
        _f("megatron layer spec: Transformer Engine (fused kernels) or the local spec; auto = TE if importable"),
    ] = "auto"
    attention: Annotated[
        Literal["auto", "local", "sdpa", "varlen"],
        _f("megatron's attention without Transformer Engine: local = megatron's DotProductAttention (keeps "
           "fp32 [rows, heads, T, T] scores per layer), sdpa = torch's scaled_dot_product_attention with the "
           "same masks (no scores kept), varlen = packed micro-batches as one row with their sequence bounds "
           "through varlen flash attention, no mask (CUDA needs bf16/fp16; CPU runs its per-sequence reference); "
           "auto = varlen on CUDA in bf16/fp16 (the torch backend's measured choice), else sdpa. Ignored with TE"),
    ] = "auto"


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(_Section):
    enabled: Annotated[
        bool,
        _f("train a LoRA adapter (PEFT) instead of every weight: only the adapter trains and sits in the optimizer, "
           "weight syncs send only the adapter, vLLM serves it as a LoRA adapter (torch backend; see docs/lora.md)"),
    ] = False
    rank: Annotated[int, _f("LoRA rank r (also vLLM's max_lora_rank)", ge=1)] = 8
    alpha: Annotated[float, _f("LoRA alpha: the adapter's update is scaled by alpha / rank", gt=0)] = 16.0
    dropout: Annotated[
        float, _f("LoRA dropout on the adapter's input while training (vLLM serves without it; 0 keeps the "
                  "learner's log-probs comparable with vLLM's)", ge=0, lt=1)
    ] = 0.0
    target_modules: Annotated[
        list[str], _f("names of the linear modules that get an adapter (PEFT target_modules); on a vision-language model "
           "only those of its language model (docs/lora.md)")
    ] = msgspec.field(default_factory=lambda: list(LORA_TARGETS))
    init: Annotated[
        Literal["default", "gaussian"],
        _f("PEFT init_lora_weights of A (B starts at zero either way, so version 0 is the base model): "
           "default = Kaiming-uniform, gaussian = normal(0, 1/rank)"),
    ] = "default"


class LearnerConfig(_Section):
    backend: Annotated[
        Literal["torch", "megatron"],
        _f("learner implementation: torch (HF model, DDP; CPU and GPU) or megatron (megatron-core GPTModel "
           "with TP/PP/DP (and EP for MoE); CUDA, or CPU with learner.device=cpu; Llama, Qwen2, Qwen3 checkpoints and the Qwen3-MoE and Qwen2-MoE mixtures of experts)"),
    ] = "torch"
    device: Annotated[
        Device,
        _f("where learner ranks train: cuda (every rank, torch or megatron, asks Ray for one GPU and uses "
           "the one Ray gave it; nccl), cpu (gloo; megatron in float32, see learner/megatron/cpu.py); "
           f"{DEVICE_AUTO}"),
    ] = "auto"
    world_size: Annotated[
        int, _f("learner ranks (torch: data parallel; megatron: tensor x pipeline x data parallel)", ge=1)
    ] = 1
    sequence_parallel_size: Annotated[
        int,
        _f("torch backend: Ulysses sequence parallelism, SP ranks per data-parallel rank (world_size = data "
           "parallel x SP): the ranks of a group split each micro-batch's tokens by position and trade positions "
           "for heads around attention (all-to-all), so one long sequence's activations spread over SP ranks; "
           "the loss and gradients equal SP = 1's. It must divide world_size and the model's attention heads "
           "(K/V heads are repeated where SP does not divide them). micro_batch_tokens counts the micro-batch's "
           "tokens over the group (auto: SP x one rank's budget). 1 = off (learner/model/ulysses.py, "
           "docs/learner.md)", ge=1),
    ] = 1
    cpus_per_rank: Annotated[int, _f("CPU cores pinned to each learner rank", ge=1)] = 1
    ray_resources: Annotated[
        dict[str, float],
        _f("custom Ray resources each learner rank also asks for, to choose its nodes: {learner_host: 1} "
           "puts ranks only on nodes started with --resources '{\"learner_host\": N}'; {} = any node"),
    ] = {}
    lr: Annotated[float, _f("AdamW learning rate", gt=0)] = 2e-3
    weight_decay: Annotated[float, _f("AdamW weight decay", ge=0)] = 0.0
    max_grad_norm: Annotated[float, _f("gradient clipping norm", gt=0)] = 1.0
    parallel: Annotated[
        Literal["ddp", "fsdp2"],
        _f("torch backend data parallelism: ddp (replicated) or fsdp2 (fully_shard: sharded parameters, "
           "gradients and optimizer state)"),
    ] = "ddp"
    micro_batch_size: Annotated[
        int, _f("sequences per micro-batch; gradients accumulate over a rank's shard (0 = one micro-batch)", ge=0)
    ] = 0
    micro_batch_tokens: Annotated[
        Annotated[int, msgspec.Meta(ge=0)] | Literal["auto"],
        _f("tokens (prompt + completion) per micro-batch, for the gradient passes and the no-grad scoring "
           "passes (proximal log-probs, the KL reference, ppo's hidden states); the shard is cut in order into "
           "the fewest micro-batches within it, balanced by tokens (learner/batch/token_budget.py, packing.py), then "
           "cut again around a micro-batch's longest sample where the learner's cost estimate for its "
           "attention path says that saves a quarter of its cost (models/cost.py, docs/learner.md); 0 = "
           "the whole shard in one pass (memory then grows with the shard: the trunk's activations per token); "
           "auto = on CUDA from the GPU's memory (its total less a tenth less what the rank holds, gradients and "
           "AdamW state) over the model's activation bytes per token, stated in one line at start-up; 8192 on CPU"),
    ] = 8192
    logprob_chunk_tokens: Annotated[
        int,
        _f("log-probs and entropy are computed from the final hidden states at the loss positions only, this "
           "many positions at a time (no positions x vocabulary tensor larger than one chunk, forward or "
           "backward: the chunk's logits are recomputed in backward); 0 = the full head at every position "
           "(the former path, several fp32 tokens x vocabulary copies; kept for comparison)", ge=0),
    ] = 1024
    logprob_keep_logits: Annotated[
        bool | Literal["auto"],
        _f("the chunked head keeps each chunk's logits (compute dtype) from the forward for the backward instead "
           "of recomputing them: one GEMM a chunk fewer (three, not four, per chunk and step: forward, the two "
           "gradients) for micro-batch loss positions x vocabulary x 2 bytes held until the micro-batch's "
           "backward (2.8 GiB for 10,000 positions with Qwen2.5's 151,936-token vocabulary; counted by "
           "micro_batch_tokens auto, and by megatron's start-up memory line), in the gradient passes only; auto = "
           "true on CUDA, false on CPU. Both backends"),
    ] = "auto"
    head_kernel: Annotated[
        Literal["auto", "compiled", "eager", "triton"],
        _f("the chunked head's per-chunk softmax arithmetic (log-sum-exp, the target's log-prob, the entropy; in "
           "backward the softmax and one-hot gradient), both backends and the KL reference pass (which runs the "
           "policy head's kernel): compiled = kernels that read the chunk's compute-dtype logits and make no fp32 "
           "copy of them (torch.compile, once per process, the chunk's length dynamic: learner/model/head_fused.py); "
           "eager = torch ops over fp32 copies; triton = the forward's statistics from a hand-written Triton "
           "kernel, one online-softmax pass over each row, its block size autotuned on the first call "
           "(learner/model/head_triton.py; CUDA only), the backward compiled (megatron: where one TP rank holds the "
           "whole vocabulary; its vocabulary-shard kernels are compiled); auto = on CUDA the fastest of the three "
           "measured at start-up on this GPU and the model's own output layer (forward and backward of two "
           "chunks, each kernel compiled first, the slowest rank's times; one line at start-up: "
           "learner/model/head_probe.py; megatron with TP or PP > 1: compiled), eager on CPU"),
    ] = "auto"
    packing: Annotated[
        bool, _f("padding-free micro-batches: sequences concatenated, position ids restart per sequence")
    ] = True
    pack_row_tokens: Annotated[
        int,
        _f("packing: tokens per packed row (0 = the longest sequence of the micro-batch); without a varlen "
           "attention kernel (CPU) a row costs attention over its width squared, so keep rows short", ge=0),
    ] = 0
    share_prompt: Annotated[
        bool,
        _f("one prompt per group: a group's samples share one copy of their prompt in a micro-batch (the "
           "completions attend to it through a block attention mask), forward and backward; equal to the "
           "unshared layout (false: every sample carries its prompt, for comparison). megatron takes it with "
           "learner.megatron.attention varlen (auto on CUDA in bf16) on one pipeline stage, else ignores it with "
           "a logged note"),
    ] = True
    attention: Annotated[
        Literal["auto", "sdpa", "varlen", "flex"],
        _f("torch backend attention kernel: sdpa (HF's SDPA: position ids for packed rows, a dense block mask "
           "for shared prompts), varlen (varlen flash attention from cumulative sequence lengths, no mask; "
           "CUDA, on CPU a slow per-sequence reference), flex (FlexAttention with a block-sparse mask; CUDA "
           "only for training); auto = sdpa on CPU, varlen on CUDA "
           "in bf16 (shared prompts too: the fastest measured, docs/learner.md), sdpa in fp32. Masks and position ids are built on "
           "the device"),
    ] = "auto"
    lr_warmup_steps: Annotated[int, _f("linear learning-rate warmup over this many steps", ge=0)] = 0
    lr_decay: Annotated[
        Literal["constant", "linear", "cosine"], _f("learning-rate decay after warmup, to lr * lr_min_ratio at the last step")
    ] = "constant"
    lr_min_ratio: Annotated[float, _f("final learning rate as a fraction of learner.lr", ge=0, le=1)] = 0.0
    mixed_precision: Annotated[
        Literal["auto", "none", "bf16", "bf16_params"],
        _f("compute dtype of the learner, weights and optimizer staying in model.dtype: bf16 = autocast (every "
           "weight re-cast per micro-batch; FSDP2: its param_dtype policy); bf16_params = the forward and "
           "backward run on a bf16 working copy of the parameters, cast once per optimizer step, with a bf16 "
           "residual stream and gradients accumulated and reduced in fp32 (FSDP2: its policy, the same thing "
           "sharded; not with lora); auto = bf16_params on CUDA (bf16 with lora), none on CPU"),
    ] = "auto"
    compile: Annotated[
        bool,
        _f("torch backend: torch.compile each decoder layer (one graph for the repeated block, dynamic shapes); "
           "the first steps pay the compile (tens of seconds on CPU). Off by default: measured by "
           "benchmarks/bench_learner.py, see docs/learner.md"),
    ] = False
    kernels: Annotated[
        Literal["auto", "liger", "compile", "none"],
        _f("torch backend: the decoder layers' kernels: liger (Liger-Kernel's Triton RMSNorm, RoPE and SwiGLU; "
           "Llama and Qwen2 on CUDA; the liger-kernel package), compile (torch.compile of each decoder layer, "
           "as learner.compile), none (the model's eager modules); auto = none on CPU, liger on CUDA where it "
           "imports and fits the model, else none (chosen before any GPU measurement: see docs/learner.md)"),
    ] = "auto"
    routing_replay: Annotated[
        Literal["auto", "on", "off"],
        _f("MoE models: rollout routing replay. on = every token with a route the engine recorded "
           "(TrajectoryGroup.routes) runs the experts the engine ran, its routing weights taken from the learner's "
           "live router (so the router still learns); tokens without a route take the live router and are counted; "
           "off = the live router everywhere; auto = on for an MoE model, off for a dense one (on with a dense "
           "model is an error). Megatron: learner/megatron/routing.py"),
    ] = "auto"
    activation_checkpointing: Annotated[
        bool,
        _f("keep only each decoder layer's input through the forward and recompute the layer in backward "
           "(torch: HF gradient checkpointing, non-reentrant; megatron: full recompute per layer): the step's "
           "activations shrink from every layer's intermediates to one hidden state per layer and token, for "
           "about one more forward of compute. Off by default: turn it on when learner memory, not time, "
           "is what limits micro_batch_tokens (measured in docs/learner.md)"),
    ] = False
    routing_replay: Annotated[
        Literal["auto", "on", "off"],
        _f("MoE models, torch backend: rollout routing replay. on = every token with a route the engine recorded "
           "(TrajectoryGroup.routes) runs the experts the engine ran, its routing weights gathered from the "
           "learner's live router softmax (so the router still learns), in the gradient and the no-grad passes "
           "(activation checkpointing's recompute replays the same); tokens without a route take the live "
           "router and are counted (moe_unrouted_tokens); off = the live router everywhere; auto = on for an "
           "MoE model, off for a dense one (on with a dense model is an error). learner/model/moe.py"),
    ] = "auto"
    moe_aux_loss_coef: Annotated[
        float,
        _f("MoE models, torch backend: weight of the load-balancing loss (Switch/HF style: experts x sum over "
           "experts of token fraction x mean router probability, per MoE layer, averaged over layers; the "
           "routing the experts ran) added to each micro-batch's loss by its share of the batch's loss tokens; "
           "0 = off; refused with learner.backend=megatron", ge=0),
    ] = 0.0
    moe_experts: Annotated[
        Literal["auto", "grouped_mm", "batched_mm", "eager"],
        _f("MoE models, torch backend: transformers' experts implementation. grouped_mm = tokens sorted by expert "
           "and two grouped GEMMs per layer (torch's grouped matmul on CUDA and CPU: no Python loop over experts, "
           "no host sync); batched_mm = every token's top-k experts' weights gathered and batch-multiplied; eager "
           "= HF's loop over the experts hit (a host sync per layer); auto = grouped_mm"),
    ] = "auto"
    routing_probe_samples: Annotated[
        int,
        _f("MoE models, torch backend: each step the first this-many samples of the rank's shard are scored twice "
           "more without gradient, with replay on and off, for the log-prob mismatch against the engine both ways "
           "(moe_mismatch_replay, moe_mismatch_live); 0 = off (only the live router's agreement is reported)", ge=0),
    ] = 8
    malloc_mmap_threshold_kb: Annotated[
        int,
        _f("glibc: allocations above this many KiB are mmap'd and returned to the OS when freed, fixed for "
           "the learner rank's process (glibc's default threshold grows to 32 MB after the first frees and the "
           "heap keeps what the step freed). With activation_checkpointing, 128 took SmolLM2-135M's peak at "
           "micro_batch_tokens 4096 from 4.6 to 3.2 GB for a 1.3x slower step (every large tensor is "
           "page-faulted afresh; docs/learner.md); 0 = glibc's dynamic default (fastest)", ge=0),
    ] = 0
    freeze_vision: Annotated[
        bool,
        _f("vision-language models: the vision tower stays as loaded (no gradient, not in the optimizer, not "
           "sent at a weight sync); the projector (patch merger) and the language model train. false: all train. "
           "With lora the projector stays frozen too (only the language model's adapter trains) and false is refused"),
    ] = True
    megatron: MegatronConfig = msgspec.field(default_factory=MegatronConfig)
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)
