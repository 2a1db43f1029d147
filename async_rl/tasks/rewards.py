"""Reward functions selectable by `task.reward`: built-ins ('math', 'exact', 'regex') and user
functions 'pkg.module:fn'. A reward function takes the whole `Sample` (prompt with answer, metadata
and data source; completion text and ids; finish reason) and returns a float, or an awaitable of
one (`async def`: remote reward models, sandboxes).

`load_reward(cfg)` builds the function from the config alone (names and strings, nothing live), so
every reward worker process rebuilds it for itself."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from async_rl.config.loading import load_callable
from async_rl.errors import ConfigError
from async_rl.protocol import Sample
from async_rl.tasks.registry import load_task

if TYPE_CHECKING:
    from async_rl.config import TaskConfig
    from async_rl.reward_models.calls import RewardModelCall

RewardFn = Callable[[Sample], float | Awaitable[float]]

BUILTIN_REWARDS = ("math", "exact", "regex")


def normalise(text: str) -> str:
    """What 'exact' and 'regex' compare: case-folded, whitespace collapsed, a final '.' dropped."""
    return " ".join(text.split()).casefold().removesuffix(".").rstrip()


def exact_reward(sample: Sample) -> float:
    """1 if the whole completion equals the answer after `normalise`, else 0."""
    return 1.0 if normalise(sample.completion) == normalise(sample.prompt.answer) else 0.0


class RegexReward:
    """The last match of `pattern` in the completion is the answer (group 1 when the pattern has a
    group, else the whole match); 1 if it equals the ground truth after `normalise`, else 0."""

    def __init__(self, pattern: str) -> None:
        if not pattern:
            raise ConfigError("task.reward_pattern must be set for task.reward=regex (e.g. 'Answer: *(\\S+)')")
        try:
            self.regex = re.compile(pattern)
        except re.error as exc:
            raise ConfigError(f"task.reward_pattern '{pattern}' is not a valid regex: {exc}") from None

    def __call__(self, sample: Sample) -> float:
        matches = list(self.regex.finditer(sample.completion))
        if not matches:
            return 0.0
        found = matches[-1].group(1 if self.regex.groups else 0) or ""
        return 1.0 if normalise(found) == normalise(sample.prompt.answer) else 0.0


def _parse_gold(answer: str) -> list:
    from math_verify import parse

    # A bare ground truth ('1/2', 'x+1') is read as LaTeX inside \boxed{}; one already in LaTeX
    # (with $ or \boxed) as written.
    gold = parse(answer if ("$" in answer or "\\boxed" in answer) else f"\\boxed{{{answer}}}")
    if not gold:
        raise ValueError(f"answer {answer!r} does not parse as math")
    return gold


def math_reward(sample: Sample) -> float:
    """math-verify: the completion's answer is its last \\boxed{} or a final-answer line ('The answer
    is 42', 'Answer: 42'; else its last number or expression), compared to `prompt.answer` by
    symbolic equivalence (1/2 == 0.5 == \\frac{1}{2}). 1 or 0; an answer that does not parse raises
    (counted as a reward error)."""
    return _math_score(sample, numbers_only=False)


def math_number_reward(sample: Sample) -> float:
    """task.math_answer=number: `math_reward`, except that for a numeric ground truth the answer must be
    written as a number. math-verify keeps an expression unevaluated and compares its value, so under
    `math_reward` a completion restating the question ('71 - 44 = ?') is right; here it scores 0."""
    return _math_score(sample, numbers_only=True)


# An answer written as a number: digits with an optional sign, decimals or a plain fraction ('1/2', which
# math-verify keeps as an unevaluated product); LaTeX forms (\frac{1}{2}, 0.5 in \boxed{}) parse to numbers.
_NUMBER_TEXT = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def _written_as_number(pred: list) -> bool:
    """math-verify's parse of an answer (value, extracted text) is a number, not an unevaluated expression."""
    written = str(pred[1]).replace(" ", "") if len(pred) > 1 else ""
    return bool(getattr(pred[0], "is_Number", False) or _NUMBER_TEXT.fullmatch(written))


def _math_score(sample: Sample, numbers_only: bool) -> float:
    from math_verify import parse, verify

    gold = _parse_gold(sample.prompt.answer)
    pred = parse(sample.completion)
    if not pred:
        return 0.0
    if numbers_only and getattr(gold[0], "is_Number", False) and not _written_as_number(pred):
        return 0.0
    return 1.0 if verify(gold, pred) else 0.0


def _load_user_reward(name: str) -> RewardFn:
    return load_callable("task.reward", name)


def load_reward(cfg: TaskConfig) -> RewardFn | RewardModelCall:
    """The reward function `cfg` names: `cfg.reward` when set, else the reward of task `cfg.name`; a
    reward model's call (judge:, classifier:), which the reward worker hands the replicas' endpoints."""
    from async_rl.config import CLASSIFIER_PREFIX, JUDGE_PREFIX

    if cfg.reward.startswith(JUDGE_PREFIX):
        from async_rl.reward_models.calls import JudgeCall

        return JudgeCall(cfg.judge)
    if cfg.reward.startswith(CLASSIFIER_PREFIX):
        from async_rl.reward_models.calls import ClassifierCall

        return ClassifierCall(cfg.classifier)
    if not cfg.reward:
        return load_task(cfg.name).reward
    if cfg.reward == "math":
        return math_number_reward if cfg.math_answer == "number" else math_reward
    if cfg.reward == "exact":
        return exact_reward
    if cfg.reward == "regex":
        return RegexReward(cfg.reward_pattern)
    if ":" in cfg.reward:
        return _load_user_reward(cfg.reward)
    raise ConfigError(
        f"task.reward '{cfg.reward}' is not a built-in reward {BUILTIN_REWARDS} nor a function 'pkg.module:fn'"
    )
