"""Built-in tasks, the dotted-path task loader, and the reward runner (timeouts, errors)."""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from async_rl.errors import ConfigError
from async_rl.generator.rewards import RewardRunner
from async_rl.protocol import REWARD_ERROR, REWARD_OK, REWARD_TIMEOUT, Prompt, Sample
from async_rl.tasks import Task, load_task
from async_rl.tasks.modsum import ModSumTask
from async_rl.tasks.repeat import RepeatTask

REPO = Path(__file__).resolve().parents[2]


def take(task: Task, seed: int, n: int) -> list[Prompt]:
    return list(itertools.islice(task.prompts(seed), n))


# ---------------------------------------------------------------- built-in tasks


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("cccccccc", 1.0),
        ("cccccccccccc", 1.0),  # only the first 8 characters count
        ("cccc", 0.5),  # short completions score less
        ("ccccxxxxcccc", 0.5),
        ("xcccccccc", 7 / 8),
        ("CCCCCCCC", 0.0),
        ("", 0.0),
        (" ccccccc", 7 / 8),
    ],
)
def test_repeat_reward(completion, reward):
    p = Prompt(prompt_id=0, text="c:", answer="c")
    assert RepeatTask().reward(Sample(prompt=p, completion=completion)) == pytest.approx(reward)


def test_repeat_custom_length():
    p = Prompt(prompt_id=0, text="a:", answer="a")
    assert RepeatTask(length=4).reward(Sample(prompt=p, completion="aaxa")) == 0.75


def test_repeat_prompts():
    prompts = take(RepeatTask(), 0, 200)
    assert [p.prompt_id for p in prompts] == list(range(200))
    for p in prompts:
        assert p.text == f"{p.answer}:"
        assert p.answer in "abcdefgh" and len(p.answer) == 1
    assert len({p.answer for p in prompts}) == 8  # every letter shows up in 200 draws


@pytest.mark.parametrize(
    "text, answer, completion, reward",
    [
        ("3+5=", "8", "8", 1.0),
        ("3+5=", "8", " 8\n", 1.0),
        ("7+6=", "3", "3", 1.0),
        ("7+6=", "3", "13", 0.0),
        ("7+6=", "3", "", 0.0),
        ("0+0=", "0", "0 is the answer", 1.0),
        ("9+9=", "8", "7", 0.0),
    ],
)
def test_modsum_reward(text, answer, completion, reward):
    assert ModSumTask().reward(Sample(prompt=Prompt(prompt_id=1, text=text, answer=answer), completion=completion)) == reward


def test_modsum_prompts_carry_the_right_answer():
    for p in take(ModSumTask(), 5, 300):
        a, b = p.text.removesuffix("=").split("+")
        assert p.text.endswith("=")
        assert p.answer == str((int(a) + int(b)) % 10)


@pytest.mark.parametrize("task_cls", [RepeatTask, ModSumTask])
def test_prompt_ids_unique_and_deterministic_per_seed(task_cls):
    a = take(task_cls(), 7, 100)
    b = take(task_cls(), 7, 100)
    c = take(task_cls(), 8, 100)
    assert a == b  # same seed, same stream
    assert len({p.prompt_id for p in a}) == 100
    assert [p.text for p in a] != [p.text for p in c]  # another seed, another stream


def test_load_builtin_tasks():
    assert isinstance(load_task("repeat"), RepeatTask)
    assert isinstance(load_task("modsum"), ModSumTask)
    assert load_task("repeat").name == "repeat"


# ---------------------------------------------------------------- user tasks by dotted path


@pytest.fixture
def repo_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))


def test_load_user_task_by_dotted_path(repo_on_path):
    task = load_task("tests.unit._user_task:make_task")
    assert isinstance(task, Task)
    assert task.name == "echo"
    first = take(task, 2, 3)
    assert [p.prompt_id for p in first] == [2000, 2001, 2002]
    assert task.reward(Sample(prompt=first[1], completion=" 1 ")) == 1.0
    assert task.reward(Sample(prompt=first[1], completion="2")) == 0.0


def config_error(name: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_task(name)
    msg = str(info.value)
    assert "\n" not in msg
    assert name in msg
    return msg


def test_module_that_does_not_import(repo_on_path):
    msg = config_error("tests.unit._no_such_module:make_task")
    assert "does not import" in msg
    assert "ModuleNotFoundError" in msg


def test_module_without_the_factory(repo_on_path):
    msg = config_error("tests.unit._user_task:make_nothing")
    assert "make_nothing" in msg
    msg = config_error("tests.unit._user_task:NOT_CALLABLE")
    assert "no callable" in msg


def test_factory_returning_a_non_task(repo_on_path):
    msg = config_error("tests.unit._user_task:make_not_a_task")
    assert "dict" in msg
    assert "not an async_rl Task" in msg


def test_unknown_name_without_colon():
    msg = config_error("no_such_task")
    assert "repeat" in msg and "modsum" in msg  # the message lists the built-ins


# ---------------------------------------------------------------- RewardRunner


class FnTask(Task):
    def __init__(self, fn: Callable[[Prompt, str], float]) -> None:
        self.fn = fn

    def prompts(self, seed: int) -> Iterator[Prompt]:
        yield Prompt(prompt_id=0, text="x", answer="y")

    def reward(self, sample: Sample) -> float:
        return self.fn(sample.prompt, sample.completion)


P = Prompt(prompt_id=3, text="c:", answer="c")


def score(fn, completion="cccc", timeout=5.0, workers=1):
    runner = RewardRunner(FnTask(fn), timeout_s=timeout, workers=workers)
    try:
        return asyncio.run(runner.score(Sample(prompt=P, completion=completion)))
    finally:
        runner.close()


def test_reward_ok():
    assert score(lambda p, c: 0.75) == (0.75, REWARD_OK)
    value, status = score(lambda p, c: 1)  # an int is turned into a float
    assert (value, status) == (1.0, REWARD_OK) and type(value) is float


def test_reward_gets_prompt_and_completion_off_the_event_loop():
    seen = {}

    def fn(p, c):
        seen["prompt"], seen["completion"] = p, c
        seen["thread"] = threading.current_thread().name
        return 0.5

    loop_thread = threading.current_thread().name
    assert score(fn, completion="ccxc") == (0.5, REWARD_OK)
    assert seen["prompt"] == P and seen["completion"] == "ccxc"
    assert seen["thread"] != loop_thread
    assert seen["thread"].startswith("reward")


def test_reward_that_raises():
    def boom(p, c):
        raise RuntimeError("user bug")

    assert score(boom) == (0.0, REWARD_ERROR)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, None, "x"])
def test_non_finite_or_non_numeric_reward(bad):
    assert score(lambda p, c: bad) == (0.0, REWARD_ERROR)


def test_reward_timeout():
    release = threading.Event()

    def slow(p, c):
        release.wait(1.0)
        return 1.0

    runner = RewardRunner(FnTask(slow), timeout_s=0.05, workers=1)
    try:
        assert asyncio.run(runner.score(Sample(prompt=P, completion="c"))) == (0.0, REWARD_TIMEOUT)
    finally:
        release.set()
        runner.close()


def test_runner_goes_on_after_a_timeout():
    release = threading.Event()
    calls = []

    def fn(p, c):
        calls.append(c)
        if c == "slow":
            release.wait(1.0)
        return 0.25

    runner = RewardRunner(FnTask(fn), timeout_s=0.05, workers=2)

    async def main():
        slow = await runner.score(Sample(prompt=P, completion="slow"))
        fast = await runner.score(Sample(prompt=P, completion="fast"))
        return slow, fast

    try:
        assert asyncio.run(main()) == ((0.0, REWARD_TIMEOUT), (0.25, REWARD_OK))
        assert calls == ["slow", "fast"]
    finally:
        release.set()
        runner.close()


def test_many_rewards_concurrently():
    runner = RewardRunner(FnTask(lambda p, c: len(c) / 10), timeout_s=5.0, workers=3)

    async def main():
        return await asyncio.gather(*(runner.score(Sample(prompt=P, completion="c" * i)) for i in range(10)))

    try:
        assert asyncio.run(main()) == [(i / 10, REWARD_OK) for i in range(10)]
    finally:
        runner.close()


def test_reward_timeout_does_not_count_time_queued_for_a_worker():
    import threading

    def takes_a_tenth(prompt, completion):
        threading.Event().wait(0.1)
        return 1.0

    runner = RewardRunner(FnTask(takes_a_tenth), timeout_s=0.35, workers=1)

    async def main():
        return await asyncio.gather(*(runner.score(Sample(prompt=P, completion="x")) for _ in range(6)))

    try:
        results = asyncio.run(main())
    finally:
        runner.close()
    # Six 0.1 s calls on one worker take 0.6 s in all; each is within its own 0.35 s budget.
    assert results == [(1.0, REWARD_OK)] * 6
