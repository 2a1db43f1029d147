"""Built-in tasks, the dotted-path task loader, and the reward runner (worker processes: errors,
timeouts, crashes, isolation)."""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import pytest

from async_rl.config import TaskConfig
from async_rl.errors import ConfigError
from async_rl.generator.rewards import RewardCounts, RewardRunner
from async_rl.protocol import REWARD_CRASH, REWARD_ERROR, REWARD_OK, REWARD_TIMEOUT, Prompt, Sample
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


@pytest.fixture(autouse=True)
def repo_on_path(monkeypatch):
    # User tasks and rewards load by name from tests.unit (in reward workers too: they get this path).
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


# ---------------------------------------------------------------- RewardRunner (worker processes)


P = Prompt(prompt_id=3, text="c:", answer="c")


def runner_for(fn: str, timeout: float = 10.0, workers: int = 1) -> RewardRunner:
    return RewardRunner(TaskConfig(reward=f"tests.unit._rewards:{fn}"), timeout_s=timeout, workers=workers)


def sample(completion: str = "cccc", **metadata) -> Sample:
    return Sample(prompt=msgspec.structs.replace(P, metadata=metadata), completion=completion)


def score(fn: str, s: Sample, timeout: float = 10.0) -> tuple[float, int]:
    runner = runner_for(fn, timeout)
    try:
        return asyncio.run(runner.score(s))
    finally:
        runner.close()


def test_reward_ok_in_another_process_with_the_whole_sample():
    s = Sample(prompt=P, completion="cc", completion_ids=[5, 6], finish_reason="length")
    pid, status = score("whoami", s)
    assert status == REWARD_OK
    assert int(pid) != os.getpid()


def test_int_reward_becomes_float():
    value, status = score("value", sample(value=1))
    assert (value, status) == (1.0, REWARD_OK) and type(value) is float


def test_async_reward():
    runner = runner_for("async_length", workers=2)

    async def main():
        return await asyncio.gather(*(runner.score(sample("c" * i)) for i in range(4)))

    try:
        assert asyncio.run(main()) == [(i / 10, REWARD_OK) for i in range(4)]
    finally:
        runner.close()


def test_task_with_an_async_reward(repo_on_path):
    runner = RewardRunner(TaskConfig(name="tests.unit._user_task:make_async_task"), timeout_s=10.0, workers=1)
    try:
        p = Prompt(prompt_id=0, text="say 1", answer="1")
        assert asyncio.run(runner.score(Sample(prompt=p, completion=" 1"))) == (1.0, REWARD_OK)
        assert asyncio.run(runner.score(Sample(prompt=p, completion="2"))) == (0.0, REWARD_OK)
    finally:
        runner.close()


def test_reward_that_raises_is_an_error_logged_with_its_sample_in_one_line(capsys):
    runner = runner_for("boom")
    s = Sample(prompt=P, completion="ends\nmid", completion_ids=[5, 6, 7], finish_reason="length")
    try:
        assert asyncio.run(runner.score(s)) == (0.0, REWARD_ERROR)
        assert runner.last_error == "RuntimeError: user bug"  # the user sees why
    finally:
        runner.close()
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[reward]")]
    assert line == (
        "[reward] error 1 on prompt 3 ('c:'): RuntimeError: user bug; finish reason length, 3 tokens ending "
        "[5, 6, 7], text 'ends\\nmid'"
    )
    # A TimeoutError raised by the reward itself is its error, not the runner's timeout.
    assert score("raises_timeout_error", sample()) == (0.0, REWARD_ERROR)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, None, "x"])
def test_non_finite_or_non_numeric_reward(bad):
    assert score("value", sample(value=bad)) == (0.0, REWARD_ERROR)


def test_reward_that_does_not_load_is_an_error_per_sample():
    runner = RewardRunner(TaskConfig(reward="tests.unit._rewards:no_such_fn"), timeout_s=10.0, workers=1)
    try:
        assert asyncio.run(runner.score(sample())) == (0.0, REWARD_ERROR)
        assert runner.counts == RewardCounts(error=1)
    finally:
        runner.close()


def test_timeout_kills_the_worker_and_the_next_call_gets_a_new_one(tmp_path):
    runner = runner_for("wait", timeout=0.5)
    pid_file = tmp_path / "pid"

    async def main():
        hung = await runner.score(sample("hang", pid_file=str(pid_file)))
        fine = await runner.score(sample("x"))
        return hung, fine

    try:
        assert asyncio.run(main()) == ((0.0, REWARD_TIMEOUT), (1.0, REWARD_OK))
        assert gone(int(pid_file.read_text()))  # the hung worker was killed
        assert runner.counts == RewardCounts(ok=1, timeout=1)
    finally:
        runner.close()


def test_a_hung_reward_costs_only_its_own_sample(tmp_path):
    # One worker: the samples submitted after the hung one queue behind it for a whole timeout, then
    # run on the replacement worker. The last one ends about 1 + 4 * 0.2 s after submission, past the
    # 1 s timeout: they are scored in full because the timeout runs from a call's start.
    runner = runner_for("wait", timeout=1.0, workers=1)

    async def main():
        return await asyncio.gather(
            runner.score(sample("hang", pid_file=str(tmp_path / "pid"))),
            *(runner.score(sample("x", wait_s=0.2)) for _ in range(4)),
        )

    try:
        results = asyncio.run(main())
    finally:
        runner.close()
    assert results == [(0.0, REWARD_TIMEOUT)] + [(1.0, REWARD_OK)] * 4
    assert runner.counts == RewardCounts(ok=4, timeout=1)


def test_reward_timeout_does_not_count_time_queued_for_a_worker():
    runner = runner_for("wait", timeout=0.35, workers=1)

    async def main():
        return await asyncio.gather(*(runner.score(sample("x", wait_s=0.1)) for _ in range(6)))

    try:
        results = asyncio.run(main())
    finally:
        runner.close()
    # Six 0.1 s calls on one worker take 0.6 s in all; each is within its own 0.35 s budget.
    assert results == [(1.0, REWARD_OK)] * 6


def test_worker_killed_by_a_signal_is_replaced_and_counted(tmp_path):
    runner = runner_for("wait", workers=2)
    pid_file = tmp_path / "pid"

    async def main():
        hung = asyncio.create_task(runner.score(sample("hang", pid_file=str(pid_file))))
        for _ in range(200):  # the worker writes its pid once it runs the call
            if pid_file.exists():
                break
            await asyncio.sleep(0.05)
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        killed = await hung
        after = await asyncio.gather(*(runner.score(sample("x")) for _ in range(4)))
        return killed, after

    try:
        killed, after = asyncio.run(main())
        assert killed == (0.0, REWARD_CRASH)
        assert runner.last_error == f"crash: the reward worker exited with code {-signal.SIGKILL}"
        assert after == [(1.0, REWARD_OK)] * 4
        assert runner.counts == RewardCounts(ok=4, crash=1)
    finally:
        runner.close()


def gone(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    return not status.exists() or "zombie" in status.read_text()


def test_pool_whose_idle_worker_died_is_replaced():
    runner = runner_for("whoami", workers=1)
    s = Sample(prompt=P, completion="cc", completion_ids=[5, 6], finish_reason="length")

    async def main():
        pid, status = await runner.score(s)
        assert status == REWARD_OK
        os.kill(int(pid), signal.SIGKILL)  # dies between calls: pebble then declares its pool broken
        for _ in range(100):
            if gone(int(pid)):
                break
            await asyncio.sleep(0.02)
        return pid, await runner.score(s)

    try:
        pid, (new_pid, status) = asyncio.run(main())
        assert status == REWARD_OK and new_pid != pid
        assert runner.pool_restarts == 1
        assert runner.counts == RewardCounts(ok=2)
    finally:
        runner.close()


OWNER = """
import asyncio, sys
from async_rl.config import TaskConfig
from async_rl.generator.rewards import RewardRunner
from async_rl.protocol import Prompt, Sample
if __name__ == "__main__":
    runner = RewardRunner(TaskConfig(reward="tests.unit._rewards:wait"), timeout_s=600, workers=1)
    prompt = Prompt(prompt_id=0, metadata={"pid_file": sys.argv[1]})
    asyncio.run(runner.score(Sample(prompt=prompt, completion="hang")))
"""


def test_a_killed_engine_leaves_no_reward_worker_behind(tmp_path):
    pid_file = tmp_path / "pid"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(pid_file)], env=env)
    try:
        for _ in range(600):  # the owner starts, its worker writes its pid once it runs the hung call
            if pid_file.exists() or owner.poll() is not None:
                break
            threading.Event().wait(0.05)
        worker = int(pid_file.read_text())
        assert not gone(worker)
    finally:
        owner.kill()  # SIGKILL: the owner cannot stop its pool
        owner.wait()
    for _ in range(100):
        if gone(worker):
            break
        threading.Event().wait(0.05)
    assert gone(worker)  # the worker, stuck in its hung reward, exited with its owner
