"""Built-in rewards (math, exact, regex, user functions) chosen by `task.reward`, and the reasoning-gym
tasks 'reasoning_gym:<dataset>' (seeded prompts, scored by the dataset's own score_answer)."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest

from async_rl.config import TaskConfig
from async_rl.errors import ConfigError
from async_rl.generator.rewards import RewardRunner
from async_rl.protocol import REWARD_ERROR, REWARD_OK, Prompt, Sample
from async_rl.tasks import load_task
from async_rl.tasks.reasoning_gym import CHUNK, ReasoningGymTask
from async_rl.tasks.rewards import RegexReward, exact_reward, load_reward, math_number_reward, math_reward

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def repo_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))  # user rewards load by name from tests.unit


def sample(answer: str, completion: str) -> Sample:
    return Sample(prompt=Prompt(prompt_id=0, text="q", answer=answer), completion=completion)


# ---------------------------------------------------------------- math (math-verify)


@pytest.mark.parametrize(
    "answer, completion, reward",
    [
        ("42", "6 * 7 = 42, so the result is $\\boxed{42}$.", 1.0),
        ("42", "First 40, then 2 more.\nThe answer is 42", 1.0),
        ("42", "Let me add: 40 + 2.\nAnswer: 42", 1.0),
        ("42", "The final answer is 42.", 1.0),
        ("\\frac{1}{2}", "So it is \\boxed{0.5}", 1.0),  # equivalent forms
        ("0.5", "\\boxed{\\frac{1}{2}}", 1.0),
        ("1/2", "The answer is 0.5", 1.0),
        ("x+1", "\\boxed{1 + x}", 1.0),
        ("$\\frac{3}{4}$", "\\boxed{0.75}", 1.0),  # a ground truth already in LaTeX
        ("42", "\\boxed{41}", 0.0),  # wrong
        ("42", "I tried 42 and 40; The answer is 41", 0.0),  # the final answer counts, not any number
        ("1/2", "\\boxed{2}", 0.0),
        ("42", "I do not know.", 0.0),  # no answer
        ("42", "", 0.0),
    ],
)
def test_math_reward(answer, completion, reward):
    assert math_reward(sample(answer, completion)) == reward


@pytest.mark.parametrize(
    "answer, completion, as_expression, as_number",
    [
        # the restated question: math-verify evaluates it (the arithmetic recipe's policy found this)
        ("27", "71 - 44 = ?", 1.0, 0.0),
        ("27", "\\boxed{71-44}", 1.0, 0.0),
        ("111", "Answer: 3*37", 1.0, 0.0),
        # seed 1's policy: math-verify takes the expression after 'The answer to', whatever follows 'is'
        ("-54", "13 - 67 = 6\n\nThe answer to 13 - 67 is 6.", 1.0, 0.0),
        ("27", "71 - 44 = 27", 1.0, 1.0),  # worked, ending on the number
        ("-23", "The answer is -23", 1.0, 1.0),
        ("0.5", "The answer is 1/2", 1.0, 1.0),  # a plain fraction is a number
        ("0.5", "\\boxed{\\frac{1}{2}}", 1.0, 1.0),
        ("27", "\\boxed{27.0}", 1.0, 1.0),
        ("27", "\\boxed{26}", 0.0, 0.0),
        ("x+1", "\\boxed{1 + x}", 1.0, 1.0),  # a symbolic ground truth: an expression is the answer
        ("27", "", 0.0, 0.0),
    ],
)
def test_math_answer_number_refuses_an_expression_for_a_numeric_answer(answer, completion, as_expression, as_number):
    assert math_reward(sample(answer, completion)) == as_expression
    assert math_number_reward(sample(answer, completion)) == as_number


def test_math_reward_ground_truth_that_does_not_parse_raises():
    with pytest.raises(ValueError, match="does not parse"):
        math_reward(sample("", "\\boxed{1}"))


# ---------------------------------------------------------------- exact and regex


@pytest.mark.parametrize(
    "answer, completion, reward",
    [
        ("Paris", "Paris", 1.0),
        ("Paris", "  paris.\n", 1.0),  # case, surrounding whitespace and a final period do not matter
        ("New York", "new   york", 1.0),
        ("Paris", "Paris, France", 0.0),
        ("Paris", "", 0.0),
    ],
)
def test_exact_reward(answer, completion, reward):
    assert exact_reward(sample(answer, completion)) == reward


@pytest.mark.parametrize(
    "pattern, completion, reward",
    [
        (r"Answer: *(\S+)", "thinking... Answer: 17", 1.0),
        (r"Answer: *(\S+)", "Answer: 3 no wait. Answer: 17", 1.0),  # the last match is the answer
        (r"Answer: *(\S+)", "Answer: 17 no wait. Answer: 3", 0.0),
        (r"Answer: *(\S+)", "17", 0.0),  # no match
        (r"\d+", "it is 17", 1.0),  # no group: the whole match
        (r"#### (.*)", "#### 17 ", 1.0),
    ],
)
def test_regex_reward(pattern, completion, reward):
    assert RegexReward(pattern)(sample("17", completion)) == reward


def config_error(cfg: TaskConfig) -> str:
    with pytest.raises(ConfigError) as info:
        load_reward(cfg)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_regex_reward_errors():
    assert "task.reward_pattern" in config_error(TaskConfig(reward="regex"))
    msg = config_error(TaskConfig(reward="regex", reward_pattern="Answer: (\\d+"))
    assert "task.reward_pattern 'Answer: (\\d+' is not a valid regex" in msg


def test_load_reward_by_name():
    assert load_reward(TaskConfig(reward="math")) is math_reward
    assert load_reward(TaskConfig(reward="math", math_answer="number")) is math_number_reward
    assert load_reward(TaskConfig(reward="exact")) is exact_reward
    assert isinstance(load_reward(TaskConfig(reward="regex", reward_pattern="a")), RegexReward)
    s = Sample(prompt=Prompt(prompt_id=0, text="c:", answer="c"), completion="cccc")
    assert load_reward(TaskConfig(name="repeat"))(s) == 0.5  # '' -> the task's own reward
    assert load_reward(TaskConfig(reward="tests.unit._rewards:length"))(s) == 0.4


def test_load_reward_errors():
    msg = config_error(TaskConfig(reward="maths"))
    assert "task.reward 'maths'" in msg and "math" in msg and "pkg.module:fn" in msg
    assert "does not import" in config_error(TaskConfig(reward="tests.unit._no_such_module:fn"))
    assert "no callable 'nope'" in config_error(TaskConfig(reward="tests.unit._rewards:nope"))


def test_builtin_reward_in_the_workers():
    runner = RewardRunner(TaskConfig(reward="math"), timeout_s=30.0, workers=1)

    async def main():
        return await asyncio.gather(
            runner.score(sample("1/2", "\\boxed{0.5}")),
            runner.score(sample("1/2", "\\boxed{0.25}")),
            runner.score(sample("", "\\boxed{1}")),  # a ground truth that does not parse: counted error
        )

    try:
        assert asyncio.run(main()) == [(1.0, REWARD_OK), (0.0, REWARD_OK), (0.0, REWARD_ERROR)]
    finally:
        runner.close()


# ---------------------------------------------------------------- reasoning-gym tasks


def take(task, seed: int, n: int, start: int = 0) -> list[Prompt]:
    return list(itertools.islice(task.prompts(seed), start, start + n))


def test_reasoning_gym_prompts_are_chats_deterministic_by_seed():
    task = load_task("reasoning_gym:basic_arithmetic")
    assert isinstance(task, ReasoningGymTask) and task.name == "reasoning_gym:basic_arithmetic"
    a, b, c = take(task, 7, 20), take(task, 7, 20), take(task, 8, 20)
    assert a == b
    assert [p.messages for p in a] != [p.messages for p in c]
    assert [p.prompt_id for p in a] == list(range(20))
    for p in a:
        assert [m.role for m in p.messages] == ["system", "user"]
        assert "<answer>" in p.messages[0].content  # the answer format the reward expects
        assert p.messages[1].content.startswith("Calculate") and p.text == ""
        assert p.answer.lstrip("-").isdigit()
        assert p.data_source == "basic_arithmetic"
        assert all(isinstance(v, int) for v in p.metadata.values())


def test_reasoning_gym_stream_goes_past_a_chunk():
    task = load_task("reasoning_gym:basic_arithmetic")
    near_the_end = take(task, 1, 4, start=CHUNK - 2)
    assert [p.prompt_id for p in near_the_end] == [CHUNK - 2, CHUNK - 1, CHUNK, CHUNK + 1]
    assert len({p.messages[1].content for p in near_the_end}) == 4
    assert near_the_end[1].metadata != near_the_end[2].metadata  # another chunk, another dataset seed


def test_reasoning_gym_reward_uses_answer_tags_and_score_answer():
    task = load_task("reasoning_gym:basic_arithmetic")
    for p in take(task, 3, 5):
        right = f"Adding up step by step.\n<answer>{p.answer}</answer>"
        wrong = f"<answer>{int(p.answer) + 1}</answer>"
        assert task.reward(Sample(prompt=p, completion=right)) == 1.0
        assert task.reward(Sample(prompt=p, completion=wrong)) == 0.0
        assert task.reward(Sample(prompt=p, completion=p.answer)) == 0.0  # no <answer> tags


def test_reasoning_gym_scored_in_a_worker_process_from_the_metadata():
    task = load_task("reasoning_gym:basic_arithmetic")
    p = take(task, 11, 1, start=CHUNK + 5)[0]
    runner = RewardRunner(TaskConfig(name="reasoning_gym:basic_arithmetic"), timeout_s=30.0, workers=1)

    async def main():
        return await asyncio.gather(
            runner.score(Sample(prompt=p, completion=f"<answer>{p.answer}</answer>")),
            runner.score(Sample(prompt=p, completion="<answer>nope</answer>")),
            runner.score(Sample(prompt=Prompt(prompt_id=1, text="x"), completion="<answer>1</answer>")),
        )

    try:
        assert asyncio.run(main()) == [(1.0, REWARD_OK), (0.0, REWARD_OK), (0.0, REWARD_ERROR)]
    finally:
        runner.close()


def test_reasoning_gym_unknown_dataset():
    with pytest.raises(ConfigError) as info:
        load_task("reasoning_gym:basic_arithmetics")
    msg = str(info.value)
    assert "\n" not in msg
    assert "reasoning_gym:basic_arithmetics" in msg and "reasoning_gym.factory" in msg
