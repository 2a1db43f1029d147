"""Per-process settings derived from the config: what each process is told when it starts."""

from __future__ import annotations

from pathlib import Path

import msgspec

from async_rl.buffer.actor import BufferSettings
from async_rl.chat import tokenizer_class_of
from async_rl.cluster import placement
from async_rl.cluster.devices import device_of, serving_dtype, use_eager, use_prefix_caching, wire_dtype
from async_rl.cluster.placement import PlacementPlan
from async_rl.config import Config, DataConfig
from async_rl.config.spec import LearnerSpec
from async_rl.envs.factory import AGENT_PREFIX
from async_rl.errors import ConfigError
from async_rl.generator.engine import EngineSettings
from async_rl.models.moe import MoeRouting, read_routing
from async_rl.protocol import LOGPROB_DTYPE, RouteLayout
from async_rl.reward_models.server import RewardEndpoint
from async_rl.security import RunKeys, frame_limit_bytes
from async_rl.serving import vllm_compat as vc
from async_rl.serving.prompt_images import EngineImages
from async_rl.serving.route_capture import RouteCapture
from async_rl.vision import image_token_id, is_vision_model

BATCH_TIMEOUT_S = 600.0


def learner_on_cuda(cfg: Config) -> bool:
    """learner.device (resolved): every rank, torch or megatron, on one GPU of its own."""
    return placement.learner_on_cuda(cfg)


def runs_on_cuda(cfg: Config) -> bool:
    """Both ends of the weight sync hold their weights on CUDA: the learner's rank 0 and the engines'
    workers (learner.device and generators.device, `auto` resolved against the cluster's GPUs)."""
    return learner_on_cuda(cfg) and placement.generators_on_cuda(cfg)


def resolve_backend(cfg: Config) -> str:
    """auto: on CUDA, CUDA IPC when learner and generators share the GPU (colocated) and NCCL when
    they have GPUs of their own (disaggregated, on one host or many); off CUDA, shared memory when
    everything runs on this host (a local Ray), gloo across hosts."""
    if cfg.weight_sync.backend != "auto":
        return cfg.weight_sync.backend
    if runs_on_cuda(cfg):
        return "cuda_ipc" if cfg.placement == "colocated" else "nccl"
    return "gloo" if cfg.ray.address else "shm"


def resolve_delta(cfg: Config) -> str:
    """weight_sync.delta, 'on' or 'off'. auto: on where the engines hold a lower precision than the
    learner's master weights (a bf16 wire dtype to fp32 masters: after an optimizer step most bf16
    values round to what they were, docs/weight-sync.md measures 4-15% changing) and the weights cross
    hosts (gloo to a Ray cluster: the bytes are what costs); off on one host, where finding and applying
    the changes took longer than sending everything (measured: 1.5-3.4x a full sync's time over gloo,
    5-8x over shm), off where every element changes (fp32 engines), for LoRA (its sync is the adapter
    alone) and on the CUDA backends (no delta there yet). 'on' where it cannot work is a one-line error
    naming the key."""
    requested = cfg.weight_sync.delta
    if requested == "off":
        return "off"
    backend, wire = resolve_backend(cfg), wire_dtype(cfg)
    lower = bool(wire) and _itemsize(wire) < _itemsize(cfg.model.dtype)
    why_not = ""
    if cfg.learner.lora.enabled:
        why_not = "learner.lora.enabled syncs the adapter alone"
    elif backend not in ("gloo", "shm"):
        why_not = f"weight_sync.backend={backend} sends full updates only (delta works over gloo and shm)"
    elif not lower:
        why_not = (f"the engines hold the learner's precision ({wire or cfg.model.dtype}): nearly every element "
                   "changes each step; delta needs bf16/fp16 engines (generators.dtype) under fp32 master weights")
    if why_not and requested == "on":
        raise ConfigError(f"weight_sync.delta=on: {why_not}")
    if why_not:
        return "off"
    across_hosts = backend == "gloo" and bool(cfg.ray.address)
    return "on" if requested == "on" or across_hosts else "off"


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4)


def with_absolute_paths(data: DataConfig) -> DataConfig:
    """Data file paths as the launch directory sees them: the buffer actor may run elsewhere."""

    def absolute(files: list[str]) -> list[str]:
        return [str(Path(f).expanduser().resolve()) for f in files]

    return msgspec.structs.replace(data, train_files=absolute(data.train_files), eval_files=absolute(data.eval_files))


def with_env_system_prompt(data: DataConfig, cfg: Config) -> DataConfig:
    """The buffer renders prompts with data.system_prompt: the environment's instructions (the tools and
    how to call them) go there too, so they are in every prompt's token ids."""
    from async_rl.envs.factory import combined_system_prompt

    return msgspec.structs.replace(data, system_prompt=combined_system_prompt(data.system_prompt, cfg.env))


def recorded_routes(cfg: Config, routing: MoeRouting | None) -> RouteLayout | None:
    """The routes every frame carries: the MoE model's layout, unless generators.capture_routes=off (or the
    model is dense)."""
    return routing.layout() if routing is not None and cfg.generators.capture_routes != "off" else None


def frame_limit(cfg: Config, routing: MoeRouting | None, vision: bool = False) -> int:
    """The buffer's frame limit in bytes (`buffer.max_frame_mb`, 0: one full-length group); a set limit
    below what one group of full-length samples needs is one line, not groups rejected as too_large
    in the run (long traces: 8 samples of 40,960 tokens need 2.6 MiB). Per token beyond an id and a
    log-prob: a teacher's log-prob (`teacher.model`) and the routes of `routing`'s MoE model (where recorded).
    The launcher checks it before anything starts (launch.check_inputs), with the same routing.
    `vision`: a vision-language model's group also carries its prompt's images, each at most
    vision.max_image_pixels RGB pixels (an encoded file is rarely larger than its raw pixels), and with
    an `env` each of its sequences may carry images of its own (an episode's, up to the same count)."""
    sequences = cfg.generators.group_size * sequences_per_episode(cfg)
    routes = recorded_routes(cfg, routing)
    extra = (routes.bytes_per_token if routes is not None else 0) + (LOGPROB_DTYPE.itemsize if cfg.teacher.model else 0)
    need = frame_limit_bytes(0, sequences, cfg.generators.max_model_len, extra)
    if vision and not cfg.buffer.max_frame_mb:
        holders = 1 + (sequences if cfg.env.name else 0)
        images = holders * cfg.vision.max_images_per_prompt * (cfg.vision.max_image_pixels or 4096 * 4096) * 3
        return -(-(need + images) // (1 << 20)) << 20
    if cfg.buffer.max_frame_mb and cfg.buffer.max_frame_mb << 20 < need:
        with_routes = f" with their routes ({routes.layers} MoE layers x top-{routes.top_k})" if routes is not None else ""
        raise ConfigError(
            f"buffer.max_frame_mb={cfg.buffer.max_frame_mb} is below one group of {sequences} samples of "
            f"generators.max_model_len={cfg.generators.max_model_len} tokens{with_routes} ({need >> 20} MiB): "
            "raise it, or 0 to compute it"
        )
    return frame_limit_bytes(cfg.buffer.max_frame_mb, sequences, cfg.generators.max_model_len, extra)


def sequences_per_episode(cfg: Config) -> int:
    """Trained sequences one episode may send: an agent episode split at prefix breaks sends one per
    segment, at most one per call (env.max_turns); every other episode sends one."""
    return cfg.env.max_turns if cfg.env.name.startswith(AGENT_PREFIX) else 1


def buffer_settings(cfg: Config, run_id: str, keys: RunKeys | None, model_dir: Path) -> BufferSettings:
    routing = read_routing(model_dir)  # the model.path the launcher checked (launch.check_inputs), now a folder
    return BufferSettings(
        run_id=run_id,
        host=cfg.buffer.host,
        ingest_port=cfg.buffer.ingest_port,
        serve_port=cfg.buffer.serve_port,
        max_lag=cfg.train.max_lag,
        prompts_per_step=cfg.train.prompts_per_step,
        group_size=cfg.generators.group_size,
        filter_uniform_groups=cfg.algorithm.dynamic_sampling,
        max_frame_bytes=frame_limit(cfg, routing, is_vision_model(model_dir)),
        routes=recorded_routes(cfg, routing),
        task_name=cfg.task.name,
        task_seed=cfg.task.seed,
        model_dir=str(model_dir),
        tokenizer_class=tokenizer_class_of(str(model_dir)),
        max_prompt_tokens=cfg.generators.max_model_len - cfg.generators.max_tokens,
        data=with_env_system_prompt(with_absolute_paths(cfg.data), cfg),
        vision=cfg.vision,
        curve=keys.server if keys is not None else None,
        deterministic=cfg.train.deterministic,
    )


def engine_images(cfg: Config, model_dir: Path) -> EngineImages | None:
    """A vision-language model's image serving (None: text only): its placeholder token, vision.* limits."""
    if not is_vision_model(model_dir):
        return None
    v = cfg.vision
    return EngineImages(image_token_id(model_dir), v.max_images_per_prompt, v.processor_kwargs(), v.max_image_pixels)


def engine_cores(plan: PlacementPlan, engine_id: int) -> list[int]:
    """The planned cores; none (unpinned) for an engine beyond the launch plan. Such an engine (a
    replacement, an operator's or the autoscaler's) may land on another node, where this machine's
    core ids mean nothing, and even here every planned core is taken (the learner's among them):
    it runs `cpus_per_engine` threads wherever Ray put it."""
    return plan.engines[engine_id].cores if engine_id < len(plan.engines) else []


def route_capture(
    setting: str, routing: MoeRouting | None, prefix_caching: bool, device: str
) -> RouteCapture | None:
    """generators.capture_routes resolved against the model and the engine; a setting that cannot
    capture what replay needs is one ConfigError line."""
    if setting == "off" or (setting == "auto" and routing is None):
        return None
    if routing is None:
        raise ConfigError("generators.capture_routes=on: the model is not a mixture of experts (no routes to record)")
    if device == "cuda" and not prefix_caching:
        raise ConfigError(
            "generators.capture_routes: vLLM's native routing capture needs prefix caching; "
            "set generators.prefix_caching=on"
        )
    if device != "cuda" and prefix_caching:
        raise ConfigError(
            "generators.capture_routes on cpu: cached prompt tokens never reach the router hook, so their routes "
            "would be missing; set generators.prefix_caching=off"
        )
    return RouteCapture(routing.num_experts, routing.top_k, list(routing.moe_layers))


def engine_settings(
    cfg: Config,
    run_id: str,
    model_dir: Path,
    plan: PlacementPlan,
    engine_id: int,
    ingest: str,
    keys: RunKeys | None,
    reward_endpoints: list[RewardEndpoint] | None = None,
    teacher_endpoints: list[RewardEndpoint] | None = None,
) -> EngineSettings:
    """`reward_endpoints`: the reward model's replicas (task.reward=judge:/classifier:);
    `teacher_endpoints`: the teacher's (teacher.model)."""
    g = cfg.generators
    device = device_of(g.device)
    return EngineSettings(
        engine_id=engine_id,
        run_id=run_id,
        spec=vc.EngineSpec(
            model_dir=str(model_dir),
            dtype=serving_dtype(cfg),
            tensor_parallel_size=g.tensor_parallel_size,
            max_model_len=g.max_model_len,
            gpu_memory_utilization=g.gpu_memory_utilization,
            seed=g.seed + engine_id,
            max_num_seqs=g.max_inflight_prompts * g.group_size,
            sleep_mode=cfg.placement == "colocated",
            device=device,
            enforce_eager=use_eager(g.enforce_eager, device),
            prefix_caching=use_prefix_caching(g.prefix_caching, device),
            lora=lora_serving(cfg),
            kv_cache_bytes=int(g.kv_cache_gib * 2**30),
            routes=route_capture(
                g.capture_routes, read_routing(model_dir), use_prefix_caching(g.prefix_caching, device), device
            ),
            images=engine_images(cfg, model_dir),
            batch_invariant=cfg.train.deterministic,
        ),
        cores=engine_cores(plan, engine_id),
        threads=g.cpus_per_engine,
        group_size=g.group_size,
        max_tokens=g.max_tokens,
        ignore_eos=g.ignore_eos,
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=g.top_k,
        min_p=g.min_p,
        stop=list(g.stop),
        max_inflight_prompts=g.max_inflight_prompts,
        pause_mode=g.pause_mode,
        env=cfg.env,
        task=cfg.task,
        reward_timeout_s=cfg.task.reward_timeout_s,
        reward_workers=cfg.task.reward_workers,
        ingest_address=ingest,
        curve=keys.engine if keys is not None else None,
        reward_endpoints=list(reward_endpoints or []),
        teacher=cfg.teacher,
        teacher_endpoints=list(teacher_endpoints or []),
        request_seed=g.seed if cfg.train.deterministic else None,
    )


def learner_spec(
    cfg: Config, run_id: str, model_dir: Path, reference_model_dir: Path, serve: str, keys: RunKeys | None
) -> LearnerSpec:
    """The learner's config sections as they are (weight_sync with its backend and wire dtype resolved), and the run's
    facts: where the weights start (`model_dir`) and the KL reference (the run's initial weights)."""
    return LearnerSpec(
        model=cfg.model,
        # devices resolved: a rank must not decide `auto` itself (it may see GPUs it was not given)
        learner=msgspec.structs.replace(cfg.learner, device=device_of(cfg.learner.device)),
        algorithm=cfg.algorithm,
        generators=msgspec.structs.replace(cfg.generators, device=device_of(cfg.generators.device)),
        train=cfg.train,
        weight_sync=msgspec.structs.replace(
            cfg.weight_sync, backend=resolve_backend(cfg), wire_dtype=wire_dtype(cfg), delta=resolve_delta(cfg)
        ),
        run_id=run_id,
        model_dir=str(model_dir),
        reference_model_dir=str(reference_model_dir),
        buffer_address=serve,
        batch_timeout_s=BATCH_TIMEOUT_S,
        curve=keys.learner if keys is not None else None,
        sft=cfg.sft,
        vision=cfg.vision,
    )


def lora_serving(cfg: Config) -> vc.LoraServing | None:
    """learner.lora: what the engines serve the trained adapter with (None: full weights)."""
    lo = cfg.learner.lora
    return vc.LoraServing(rank=lo.rank, alpha=lo.alpha, target_modules=list(lo.target_modules)) if lo.enabled else None
