"""Per-process settings derived from the config: what each process is told when it starts."""

from __future__ import annotations

from pathlib import Path

import msgspec

from async_rl.buffer.actor import BufferSettings
from async_rl.cluster.placement import PlacementPlan, available_cores
from async_rl.config import Config, DataConfig
from async_rl.generator import vllm_compat as vc
from async_rl.generator.engine import EngineSettings
from async_rl.learner.base import LearnerSettings
from async_rl.learner.megatron_learner import MegatronSettings
from async_rl.security import RunKeys, frame_limit_bytes

BATCH_TIMEOUT_S = 600.0


def learner_on_cuda(cfg: Config) -> bool:
    """The megatron learner trains on CUDA; the torch learner on CPU."""
    return cfg.learner.backend == "megatron"


def resolve_backend(cfg: Config) -> str:
    """auto: CUDA IPC when learner and generators share the GPU (colocated with a CUDA learner);
    otherwise shared memory when everything runs on this host (a local Ray), gloo across hosts."""
    if cfg.weight_sync.backend != "auto":
        return cfg.weight_sync.backend
    if cfg.placement == "colocated" and learner_on_cuda(cfg):
        return "cuda_ipc"
    return "gloo" if cfg.ray.address else "shm"


def with_absolute_paths(data: DataConfig) -> DataConfig:
    """Data file paths as the launch directory sees them: the buffer actor may run elsewhere."""

    def absolute(files: list[str]) -> list[str]:
        return [str(Path(f).expanduser().resolve()) for f in files]

    return msgspec.structs.replace(data, train_files=absolute(data.train_files), eval_files=absolute(data.eval_files))


def buffer_settings(cfg: Config, run_id: str, keys: RunKeys | None, model_dir: Path) -> BufferSettings:
    return BufferSettings(
        run_id=run_id,
        host=cfg.buffer.host,
        ingest_port=cfg.buffer.ingest_port,
        serve_port=cfg.buffer.serve_port,
        max_lag=cfg.train.max_lag,
        prompts_per_step=cfg.train.prompts_per_step,
        group_size=cfg.generators.group_size,
        filter_uniform_groups=cfg.algorithm.dynamic_sampling,
        max_frame_bytes=frame_limit_bytes(
            cfg.buffer.max_frame_mb, cfg.generators.group_size, cfg.generators.max_model_len
        ),
        task_name=cfg.task.name,
        task_seed=cfg.task.seed,
        model_dir=str(model_dir),
        max_prompt_tokens=cfg.generators.max_model_len - cfg.generators.max_tokens,
        data=with_absolute_paths(cfg.data),
        curve=keys.server if keys is not None else None,
    )


def engine_cores(plan: PlacementPlan, engine_id: int, cpus_per_engine: int) -> list[int]:
    """The planned cores; an engine added later wraps around the machine's cores."""
    if engine_id < len(plan.engines):
        return plan.engines[engine_id].cores
    cores = available_cores()
    return [cores[(engine_id * cpus_per_engine + i) % len(cores)] for i in range(cpus_per_engine)]


def engine_settings(
    cfg: Config,
    run_id: str,
    model_dir: Path,
    plan: PlacementPlan,
    engine_id: int,
    ingest: str,
    keys: RunKeys | None,
) -> EngineSettings:
    g = cfg.generators
    return EngineSettings(
        engine_id=engine_id,
        run_id=run_id,
        spec=vc.EngineSpec(
            model_dir=str(model_dir),
            dtype=cfg.model.dtype,
            tensor_parallel_size=g.tensor_parallel_size,
            max_model_len=g.max_model_len,
            gpu_memory_utilization=g.gpu_memory_utilization,
            seed=g.seed + engine_id,
            max_num_seqs=g.max_inflight_prompts * g.group_size,
            sleep_mode=cfg.placement == "colocated",
        ),
        cores=engine_cores(plan, engine_id, g.cpus_per_engine),
        kv_cache_gib=g.kv_cache_gib,
        group_size=g.group_size,
        max_tokens=g.max_tokens,
        ignore_eos=g.ignore_eos,
        temperature=g.temperature,
        max_inflight_prompts=g.max_inflight_prompts,
        pause_mode=g.pause_mode,
        task_name=cfg.task.name,
        reward_timeout_s=cfg.task.reward_timeout_s,
        reward_workers=cfg.task.reward_workers,
        ingest_address=ingest,
        curve=keys.engine if keys is not None else None,
    )


def learner_settings(
    cfg: Config, run_id: str, model_dir: Path, serve: str, keys: RunKeys | None
) -> LearnerSettings:
    lc, ws = cfg.learner, cfg.weight_sync
    return LearnerSettings(
        model_dir=str(model_dir),
        dtype=cfg.model.dtype,
        lr=lc.lr,
        weight_decay=lc.weight_decay,
        max_grad_norm=lc.max_grad_norm,
        algorithm=cfg.algorithm,
        max_tokens=cfg.generators.max_tokens,
        temperature=cfg.generators.temperature,
        seed=cfg.train.seed,
        run_id=run_id,
        buffer_address=serve,
        batch_timeout_s=BATCH_TIMEOUT_S,
        bucket_mb=ws.bucket_mb,
        weight_sync_host=ws.host,
        weight_sync_port=ws.port,
        weight_sync_timeout_s=ws.timeout_s,
        weight_sync_backend=resolve_backend(cfg),
        weight_checksum=ws.checksum,
        wire_dtype=ws.wire_dtype,
        parallel=lc.parallel,
        micro_batch_size=lc.micro_batch_size,
        micro_batch_tokens=lc.micro_batch_tokens,
        packing=lc.packing,
        pack_row_tokens=lc.pack_row_tokens,
        total_steps=cfg.train.total_steps,
        lr_warmup_steps=lc.lr_warmup_steps,
        lr_decay=lc.lr_decay,
        lr_min_ratio=lc.lr_min_ratio,
        mixed_precision=lc.mixed_precision,
        curve=keys.learner if keys is not None else None,
    )


def megatron_settings(cfg: Config) -> MegatronSettings:
    m = cfg.learner.megatron
    return MegatronSettings(
        tensor_parallel_size=m.tensor_parallel_size,
        pipeline_parallel_size=m.pipeline_parallel_size,
        micro_batches=m.micro_batches,
        distributed_optimizer=m.distributed_optimizer,
        transformer_engine=m.transformer_engine,
        probe_samples=cfg.train.mismatch_probe_samples,
    )
