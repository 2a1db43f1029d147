"""What the prompts are: the task, the data files, a vision-language model's images."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from async_rl.config.base import _f, _Section
from async_rl.config.rewards import ClassifierConfig, JudgeConfig


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
    math_answer: Annotated[
        Literal["expression", "number"],
        _f(
            "what task.reward=math takes as an answer: 'expression' (math-verify's own rule: any expression "
            "equal to the ground truth, so a completion restating an arithmetic question, '71 - 44 = ?', "
            "scores as 27) or 'number' (for numeric ground truths the answer must be written as a number: "
            "42, -23, 0.5, 1/2, \\frac{1}{2}; an unevaluated expression scores 0)"
        ),
    ] = "expression"
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
        int, _f("the processor's lower pixel bound per image, for engines and learner alike (0: the model's processor's own); "
                "Qwen-VL only (LLaVA resizes every image to one size: refused)", ge=0)
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
