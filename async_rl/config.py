"""The typed config tree: YAML file + `section.key=value` overrides -> msgspec Structs.

Every field carries a one-line description (msgspec `Meta(description=...)`); `describe()` prints
them, and `--dry-run` prints the resolved values. Errors are one line that names the key.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml

from async_rl.errors import ConfigError


def _f(description: str, **constraints: Any) -> msgspec.Meta:
    return msgspec.Meta(description=description, **constraints)


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class ModelConfig(_Section):
    path: Annotated[str, _f("built-in preset ('tiny-qwen2'; 'tiny-qwen2-wide', 13M, for benchmarks) or a local HF model directory")] = (
        "tiny-qwen2"
    )
    cache_dir: Annotated[str, _f("where built-in presets are created (offline) and cached")] = (
        "~/.cache/async_rl/models"
    )
    dtype: Annotated[Literal["float32", "bfloat16", "float16"], _f("dtype of learner and generators")] = (
        "float32"
    )


class TaskConfig(_Section):
    name: Annotated[str, _f("built-in task ('repeat', 'modsum') or a factory 'pkg.module:make_task'")] = (
        "repeat"
    )
    seed: Annotated[int, _f("seed of the prompt stream")] = 0
    reward_timeout_s: Annotated[float, _f("a reward call slower than this scores 0 and is counted", gt=0)] = 5.0
    reward_workers: Annotated[int, _f("threads per engine that run reward functions", ge=1)] = 2


class GeneratorConfig(_Section):
    num_engines: Annotated[int, _f("number of vLLM engines in the generator pool", ge=1)] = 1
    tensor_parallel_size: Annotated[int, _f("vLLM tensor-parallel workers per engine", ge=1)] = 1
    cpus_per_engine: Annotated[int, _f("CPU cores pinned to each engine (its vLLM OpenMP threads)", ge=1)] = 1
    group_size: Annotated[int, _f("completions sampled per prompt (the GRPO group)", ge=1)] = 8
    max_tokens: Annotated[int, _f("maximum completion length in tokens", ge=1)] = 8
    ignore_eos: Annotated[
        bool, _f("keep sampling past the end-of-sequence token: every completion is max_tokens long (benchmarks)")
    ] = False
    temperature: Annotated[float, _f("sampling temperature (the learner divides its logits by it too)", gt=0)] = 1.0
    max_model_len: Annotated[int, _f("vLLM max sequence length (prompt + completion)", ge=8)] = 128
    max_inflight_prompts: Annotated[int, _f("prompts an engine keeps in flight at once", ge=1)] = 16
    kv_cache_gib: Annotated[float, _f("KV cache size per engine on CPU (VLLM_CPU_KVCACHE_SPACE), GiB", gt=0)] = 1.0
    gpu_memory_utilization: Annotated[float, _f("fraction of GPU memory vLLM may use (GPU only)", gt=0, le=1)] = 0.5
    pause_mode: Annotated[
        Literal["keep", "wait", "abort"],
        _f("weight update with requests in flight: keep (freeze, continue on new weights), "
           "abort (cut, resubmit the rest), wait (finish them on the old weights first)"),
    ] = "keep"
    seed: Annotated[int, _f("vLLM sampling seed")] = 0


class TrainConfig(_Section):
    total_steps: Annotated[int, _f("optimizer steps to run", ge=1)] = 60
    prompts_per_step: Annotated[int, _f("prompt groups per optimizer step (batch = this * group_size)", ge=1)] = 8
    max_lag: Annotated[int, _f("max policy versions a trained sample may lag (0 = synchronous on-policy)", ge=0)] = 1
    sync_every: Annotated[int, _f("optimizer steps between weight syncs to the generators", ge=1)] = 1
    mismatch_probe_samples: Annotated[
        int, _f("after each sync, samples scored by learner and vLLM to measure their log-prob mismatch", ge=0)
    ] = 8
    seed: Annotated[int, _f("seed of the learner")] = 0


class LearnerConfig(_Section):
    backend: Annotated[Literal["torch"], _f("learner implementation")] = "torch"
    world_size: Annotated[int, _f("learner ranks (data parallel)", ge=1)] = 1
    cpus_per_rank: Annotated[int, _f("CPU cores pinned to each learner rank", ge=1)] = 1
    lr: Annotated[float, _f("AdamW learning rate", gt=0)] = 2e-3
    weight_decay: Annotated[float, _f("AdamW weight decay", ge=0)] = 0.0
    max_grad_norm: Annotated[float, _f("gradient clipping norm", gt=0)] = 1.0
    clip_eps_low: Annotated[float, _f("PPO clip: ratio lower bound is 1 - this", ge=0)] = 0.2
    clip_eps_high: Annotated[float, _f("PPO clip: ratio upper bound is 1 + this", ge=0)] = 0.2
    tis_cap: Annotated[float, _f("truncated importance sampling: cap on pi/mu in the unclipped term", gt=1)] = 2.0
    advantage: Annotated[Literal["grpo"], _f("advantage estimator")] = "grpo"


class BufferConfig(_Section):
    host: Annotated[str, _f("interface the buffer's ZMQ sockets bind to")] = "127.0.0.1"
    ingest_port: Annotated[int, _f("ZMQ PULL port for trajectories (0 = any free port)", ge=0, le=65535)] = 0
    serve_port: Annotated[int, _f("ZMQ ROUTER port serving batches to learner ranks (0 = any free)", ge=0, le=65535)] = 0
    filter_uniform_groups: Annotated[bool, _f("drop (count as filtered) groups whose rewards are all equal")] = False
    max_frame_mb: Annotated[int, _f("largest accepted trajectory frame, MiB", ge=1)] = 64


class WeightSyncConfig(_Section):
    backend: Annotated[
        Literal["auto", "gloo", "shm", "nccl"],
        _f("weight transport: gloo (sockets, any host), shm (shared memory, one host), nccl (CuPy, "
           "CUDA tensors); auto = shm on a local Ray, else gloo"),
    ] = "auto"
    wire_dtype: Annotated[
        Literal["", "float32", "bfloat16", "float16"], _f("cast floating weights to this dtype on the wire ('' = none)")
    ] = ""
    bucket_mb: Annotated[int, _f("size of one broadcast bucket, MiB", ge=1)] = 64
    host: Annotated[str, _f("address of learner rank 0 for the broadcast group rendezvous")] = "127.0.0.1"
    port: Annotated[int, _f("rendezvous port of the broadcast group (0 = any free port)", ge=0, le=65535)] = 0
    timeout_s: Annotated[float, _f("a broadcast group that does not form or move in this time fails", gt=0)] = 120.0
    checksum: Annotated[bool, _f("verify every update with a checksum of its bytes on both sides")] = True


class WandbConfig(_Section):
    mode: Annotated[Literal["offline", "online", "disabled"], _f("wandb mode (offline needs no account)")] = "offline"
    project: Annotated[str, _f("wandb project name")] = "async_rl"


class LoggingConfig(_Section):
    run_dir: Annotated[str, _f("parent folder of run directories")] = "runs"
    run_name: Annotated[str, _f("run directory name ('' = timestamp)")] = ""
    wandb: WandbConfig = msgspec.field(default_factory=WandbConfig)


class RayConfig(_Section):
    address: Annotated[str, _f("Ray cluster address ('' = start a local Ray)")] = ""
    num_cpus: Annotated[int, _f("logical CPUs of a local Ray (0 = enough for the placement plan)", ge=0)] = 0
    actor_logs: Annotated[bool, _f("show the logs of Ray actors (vLLM, learner) on the console")] = False


class Config(_Section):
    placement: Annotated[
        Literal["disaggregated", "colocated"],
        _f("disaggregated: generators and learner on separate cores, asynchronous; colocated: they "
           "share the cores and alternate (needs train.max_lag 0)"),
    ] = "disaggregated"
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    task: TaskConfig = msgspec.field(default_factory=TaskConfig)
    generators: GeneratorConfig = msgspec.field(default_factory=GeneratorConfig)
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    buffer: BufferConfig = msgspec.field(default_factory=BufferConfig)
    weight_sync: WeightSyncConfig = msgspec.field(default_factory=WeightSyncConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    ray: RayConfig = msgspec.field(default_factory=RayConfig)


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads '1e-3' (no dot) as a string; accept it as the float users mean."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _yaml(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


_MSGSPEC_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`")
_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `(?P<name>[^`]+)`")


def _one_line(err: msgspec.ValidationError) -> str:
    """Turn msgspec's message ('... - at `$.learner.lr`') into 'learner.lr: ...'."""
    text = str(err)
    m = _MSGSPEC_PATH.search(text)
    path = m.group("path").lstrip(".") if m else ""
    text = _MSGSPEC_PATH.sub("", text)
    unknown = _UNKNOWN_FIELD.search(text)
    if unknown:
        key = f"{path}.{unknown.group('name')}" if path else unknown.group("name")
        return f"unknown config key '{key}'"
    return f"config key '{path or '<root>'}': {text}"


def apply_override(tree: dict[str, Any], override: str) -> None:
    """Apply one `a.b.c=value` override; the value is parsed as YAML (so 3, true, [1, 2] work)."""
    if "=" not in override:
        raise ConfigError(f"override '{override}' is not of the form section.key=value")
    dotted, raw = override.split("=", 1)
    keys = dotted.strip().split(".")
    if not all(keys):
        raise ConfigError(f"override '{override}' has an empty key")
    try:
        value = _yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override '{override}': value is not valid YAML ({exc.__class__.__name__})") from None
    node = tree
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override '{override}': '{'.'.join(keys[: i + 1])}' is not a section")
        node = child
    node[keys[-1]] = value


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config, apply overrides, convert to typed Structs and check cross-field rules."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist")
        try:
            loaded = _yaml(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file '{p}' is not valid YAML: {str(exc).splitlines()[0]}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file '{p}' must hold a mapping of sections at the top level")
        # An empty section ('learner:' with nothing under it) means "all defaults".
        tree = {k: ({} if v is None else v) for k, v in (loaded or {}).items()}
    for override in overrides:
        apply_override(tree, override)
    try:
        cfg = msgspec.convert(tree, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(_one_line(exc)) from None
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Rules that involve more than one field."""
    t = cfg.train
    if t.max_lag < t.sync_every - 1:
        raise ConfigError(
            f"train.max_lag={t.max_lag} is below train.sync_every-1={t.sync_every - 1}: "
            "the learner would wait for samples no generator may produce"
        )
    if t.prompts_per_step % cfg.learner.world_size:
        raise ConfigError(
            f"train.prompts_per_step={t.prompts_per_step} is not divisible by learner.world_size="
            f"{cfg.learner.world_size}"
        )
    if cfg.placement == "colocated" and t.max_lag != 0:
        raise ConfigError(f"placement=colocated alternates generation and training: it needs train.max_lag=0, not {t.max_lag}")
    if cfg.generators.max_tokens >= cfg.generators.max_model_len:
        raise ConfigError("generators.max_tokens must be below generators.max_model_len")


def to_dict(cfg: Config) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def describe(struct_type: type[msgspec.Struct] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, description) for every leaf field: the config reference."""
    rows: list[tuple[str, str, str]] = []
    default = struct_type()
    for field in msgspec.structs.fields(struct_type):
        key = f"{prefix}{field.name}"
        value = getattr(default, field.name)
        if isinstance(value, msgspec.Struct):
            rows.extend(describe(type(value), key + "."))
            continue
        desc = ""
        for meta in getattr(field.type, "__metadata__", ()):
            if isinstance(meta, msgspec.Meta) and meta.description:
                desc = meta.description
        rows.append((key, repr(value), desc))
    return rows
