"""The reward model's pool as the config says (task.reward=judge:<model> or classifier:<folder>)."""

from __future__ import annotations

import secrets

from async_rl.cluster.devices import device_of, use_eager, use_prefix_caching
from async_rl.cluster.placement import replica_bundle
from async_rl.config import CLASSIFIER_PREFIX, JUDGE_PREFIX, Config, VllmReplicaServing
from async_rl.models.tiny import resolve_model_path
from async_rl.reward_models.classifier import ClassifierServer, ClassifierSettings
from async_rl.reward_models.judge_engine import JudgeEngine, JudgeSettings
from async_rl.reward_models.pool import RewardModelPool
from async_rl.serving import vllm_compat as vc


def _dtype(value: str, device: str) -> str:
    return value if value != "auto" else ("bfloat16" if device == "cuda" else "float32")


def replica_engine_spec(serving: VllmReplicaServing, model_dir: str, max_model_len: int, replica_id: int) -> vc.EngineSpec:
    """The vLLM engine of one replica that serves a model of its own (the judge, the teacher)."""
    device = device_of(serving.device)
    return vc.EngineSpec(
        model_dir=model_dir, dtype=_dtype(serving.dtype, device), tensor_parallel_size=serving.tensor_parallel_size,
        max_model_len=max_model_len, gpu_memory_utilization=serving.gpu_memory_utilization, seed=replica_id,
        max_num_seqs=serving.max_inflight, device=device, enforce_eager=use_eager("auto", device),
        prefix_caching=use_prefix_caching("auto", device), kv_cache_bytes=int(serving.kv_cache_gib * 2**30),
    )


def replica_host(cfg: Config) -> str:
    """What a replica binds: loopback in a local run; '' (its node's IP, resolved where it runs) on a Ray
    cluster, whose reward workers may run on other nodes."""
    return "" if cfg.ray.address else "127.0.0.1"


def reward_model_pool(cfg: Config, key: str = "") -> RewardModelPool | None:
    """The pool task.reward names (not started), or None for a reward without a model. `key`: the run's
    key for the replicas' endpoints (a fresh one when not given)."""
    task = cfg.task
    key = key or secrets.token_urlsafe(32)
    if task.reward.startswith(JUDGE_PREFIX):
        j = task.judge
        model = task.reward.removeprefix(JUDGE_PREFIX)
        model_dir = str(resolve_model_path(model, cfg.model.cache_dir))

        def judge_settings(replica_id: int) -> JudgeSettings:
            spec = replica_engine_spec(j, model_dir, j.max_model_len, replica_id)
            return JudgeSettings(replica_id=replica_id, spec=spec, model_name=model, key=key, threads=j.cpus_per_replica,
                                 hang_s=j.hang_s, max_tokens=j.max_tokens, temperature=j.temperature,
                                 host=replica_host(cfg))

        return RewardModelPool("judge", JudgeEngine, judge_settings, j.replicas, replica_bundle(j, j.tensor_parallel_size))
    if task.reward.startswith(CLASSIFIER_PREFIX):
        c = task.classifier
        folder = str(resolve_model_path(task.reward.removeprefix(CLASSIFIER_PREFIX), cfg.model.cache_dir))
        device = device_of(c.device)

        def classifier_settings(replica_id: int) -> ClassifierSettings:
            return ClassifierSettings(
                replica_id=replica_id, folder=folder, key=key, device=device, dtype=_dtype(c.dtype, device),
                threads=c.cpus_per_replica, input_mode=c.input, label=c.label, transform=c.transform,
                max_length=c.max_length, max_batch=c.max_batch, batch_wait_ms=c.batch_wait_ms, host=replica_host(cfg),
            )

        return RewardModelPool("classifier", ClassifierServer, classifier_settings, c.replicas, replica_bundle(c, 1))
    return None
