"""A run that cannot learn stops with one line; partial failure stays a counter (failure_watch.py and
the supervisor's decision)."""

from __future__ import annotations

import io
from types import SimpleNamespace

import msgspec
import pytest

from async_rl.buffer.actor import BufferStats
from async_rl.buffer.ledger import Accounts
from async_rl.config import Config, TaskConfig
from async_rl.control.checkpoint import RUN_STATE
from async_rl.control.failure_watch import FailureWatch, FailureWindow, reward_name
from async_rl.control.supervisor import Supervisor
from async_rl.errors import RunError
from async_rl.evaluation.scores import EvalRecord
from async_rl.generator.engine import EngineStats

NAME = reward_name("repeat", "tests.unit._rewards:boom")


def test_failure_window_from_the_start_and_later():
    w = FailureWindow(8)
    assert not w.observe(ok=0, failed=7)
    assert w.observe(ok=0, failed=8) and w.from_start  # the first 8 samples all failed
    w = FailureWindow(8)
    assert not w.observe(ok=1, failed=7)  # one success: the failures before it do not count
    assert not w.observe(ok=1, failed=14)
    assert w.observe(ok=1, failed=15) and not w.from_start  # 8 in a row after the last success
    assert not w.observe(ok=2, failed=40)  # a success between two looks: the run of failures restarts
    assert not w.observe(ok=2, failed=47) and w.observe(ok=2, failed=48)


def test_failure_window_zero_never_stops():
    w = FailureWindow(0)
    assert not w.observe(ok=0, failed=10_000)


def stats(arrived: int, errors: int = 0, timeouts: int = 0, crashes: int = 0, lost: int = 0,
          rejected: dict[str, int] | None = None) -> BufferStats:
    return BufferStats(
        accounts=Accounts(trained=arrived, lost=lost),
        generator_version=0,
        waiting_groups=0,
        rejected_frames=rejected or {},
        reward_errors=errors,
        reward_timeouts=timeouts,
        reward_crashes=crashes,
        last_batch_step=0,
        last_batch_max_lag=0,
        last_batch_mean_lag=0.0,
        prompts_exhausted=False,
    )


def test_every_reward_failing_stops_naming_the_reward_and_the_kind():
    watch = FailureWatch(16, NAME)
    assert watch.check(stats(8, errors=8)) is None  # not a whole window yet
    failing = watch.check(stats(16, errors=12, timeouts=4))
    assert failing is not None and failing.source == "reward"
    assert failing.message == (
        "the reward task.reward=tests.unit._rewards:boom failed on every one of the first 16 samples "
        "(error; error 12, timeout 4): the run cannot learn (task.failure_window=16)"
    )


def test_partial_reward_failure_is_only_counted():
    watch = FailureWatch(16, NAME)
    for step in range(1, 50):  # 3 of every 4 samples fail, every step
        assert watch.check(stats(16 * step, errors=4 * step, timeouts=4 * step, crashes=4 * step)) is None


def test_a_sustained_window_later_in_the_run_stops_it_with_its_own_counts():
    watch = FailureWatch(16, NAME)
    assert watch.check(stats(64, errors=3)) is None  # learning fine
    assert watch.check(stats(80, errors=3, timeouts=10)) is None  # 10 timeouts after the last success
    failing = watch.check(stats(96, errors=3, timeouts=26))
    assert failing is not None
    assert "16 samples in a row (timeout; timeout 16)" in failing.message  # the errors before it are not counted


def test_every_episode_failing_stops_the_run():
    watch = FailureWatch(16, NAME, env_name="tools")
    assert watch.check(stats(0, lost=8)) is None
    failing = watch.check(stats(0, lost=16))
    assert failing is not None and failing.source == "request"
    assert failing.message.startswith("every episode of env tools failed: the first 16 samples were lost")


def eval_record(samples: int, failures: int, failed_prompts: int = 0) -> EvalRecord:
    return EvalRecord(
        step=3, version=3, elapsed_s=1.0, eval_s=1.0, prompts=samples // 2, samples=samples, reward=0.0, pass_at_1=0.0,
        completion_len_mean=1.0, completion_len_max=1, truncated_frac=0.0, failed_prompts=failed_prompts,
        reward_failures=failures, per_source={},
    )  # fmt: skip


def test_evaluation_whose_rewards_all_failed_stops_the_run():
    watch = FailureWatch(16, NAME)
    assert watch.check_eval(eval_record(8, failures=7)) is None
    failing = watch.check_eval(eval_record(8, failures=8))
    assert failing is not None and failing.message == f"evaluation at step 3: {NAME} failed on every one of its 8 samples"
    assert watch.check_eval(eval_record(0, failures=0, failed_prompts=4)).source == "request"
    assert FailureWatch(0, NAME).check_eval(eval_record(8, failures=8)) is None  # 0 disables


def supervisor(tmp_path, engines: list[EngineStats], window: int = 16) -> Supervisor:
    cfg = Config(task=TaskConfig(reward="tests.unit._rewards:boom", failure_window=window))
    rt = SimpleNamespace(generators=SimpleNamespace(stats=lambda: engines))
    return Supervisor(rt, cfg, tmp_path, "run", io.StringIO())


def engine(reward_error: str = "", request_error: str = "") -> EngineStats:
    return EngineStats(
        engine_id=0, version=0, groups_pushed=0, samples_pushed=0, tokens_generated=0, inflight=0, paused=False,
        idle_s=0.0, failed_requests=0, last_error=request_error, reward_last_error=reward_error,
    )  # fmt: skip


def test_supervisor_stops_with_one_line_and_the_last_error(tmp_path):
    sup = supervisor(tmp_path, [engine(), engine(reward_error="RuntimeError: user bug")])
    try:
        sup.check_failures(stats(4, errors=4))
        with pytest.raises(RunError) as info:
            sup.check_failures(stats(16, errors=16))
    finally:
        sup.close()
    line = str(info.value)
    assert "\n" not in line
    assert line == (
        "the reward task.reward=tests.unit._rewards:boom failed on every one of the first 16 samples (error; error 16): "
        "the run cannot learn (task.failure_window=16); last error: RuntimeError: user bug"
    )


def test_lost_samples_with_no_engine_error_are_explained_by_the_frames_the_buffer_rejected(tmp_path):
    """Samples are also counted lost when the buffer rejects their frame (no engine sees an error): the
    stop line then names the rejected frames by reason instead of saying nothing was recorded."""
    sup = supervisor(tmp_path, [engine()])
    try:
        sup.check_failures(stats(64))
        with pytest.raises(RunError) as info:
            sup.check_failures(stats(64, lost=16, rejected={"bad_value": 2, "group_size": 1}))
    finally:
        sup.close()
    assert str(info.value).endswith(
        "16 samples in a row were lost and none arrived (task.failure_window=16); last error: none recorded "
        "by an engine; frames the buffer rejected: bad_value 2, group_size 1"
    )


def test_supervisor_with_window_zero_never_stops(tmp_path):
    sup = supervisor(tmp_path, [engine(reward_error="RuntimeError: user bug")], window=0)
    try:
        sup.check_failures(stats(10_000, errors=10_000))
        sup.check_eval(eval_record(8, failures=8))
    finally:
        sup.close()


def test_a_buffer_snapshot_that_did_not_fit_stops_the_run_naming_the_checkpoint(tmp_path):
    (tmp_path / "checkpoints" / "step_4").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_4" / RUN_STATE).write_text("{}")  # complete: its run state is written
    sup = supervisor(tmp_path, [engine()])
    full = "buffer snapshot: no space left on the device of /x/buffer_snapshot.msgpack: needs about 1.0 KiB (1024 bytes), 0.0 KiB (0 bytes) free"
    try:
        sup.check_failures(stats(8))  # no storage error: nothing happens
        with pytest.raises(RunError) as info:
            sup.check_failures(msgspec.structs.replace(stats(8), storage_error=full))
    finally:
        sup.close()
    assert str(info.value) == f"{full}; free space, then --resume {tmp_path} (from step_4)"
