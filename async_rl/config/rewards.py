"""Reward models and the teacher: the LLM judge, the classifier, the distillation teacher, and their serving."""

from __future__ import annotations

from typing import Annotated, Literal

from async_rl.config.base import DEVICE_AUTO, Device, _f, _Section

JUDGE_PREFIX = "judge:"
CLASSIFIER_PREFIX = "classifier:"
# What a judge template may name: the prompt as the policy saw it, the completion, the reference answer.


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
