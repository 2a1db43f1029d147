"""The learner-recovery policy (async_rl/control/recovery.py): mode, the window of max_recoveries, the
checkpoint a restart starts from, and the one line that stops the run. No Ray."""

import pytest

from async_rl.config import TrainConfig
from async_rl.control.recovery import LearnerRecovery, RestartPlan
from async_rl.errors import RunError

CKPT = "/runs/r/checkpoints/step_4"


def test_defaults_recover_automatically():
    t = TrainConfig()
    assert (t.recover, t.max_recoveries, t.recovery_window_steps) == ("auto", 3, 100)


def test_restart_starts_from_the_newest_checkpoint_and_counts():
    policy = LearnerRecovery("auto", max_recoveries=2, window_steps=0)
    plan = policy.decide(6, "learner rank 1 died (killed)", CKPT, 4)
    assert plan == RestartPlan(checkpoint=CKPT, step=4, recoveries=1)
    assert policy.recoveries == 1


def test_without_a_checkpoint_the_group_restarts_from_the_initial_weights_at_step_0():
    plan = LearnerRecovery("auto", 1, 0).decide(2, "learner rank 0 died (x)", None, None)
    assert plan == RestartPlan(checkpoint=None, step=0, recoveries=1)


def test_recover_off_stops_with_todays_line_naming_the_checkpoint():
    err = LearnerRecovery("off", 3, 100).decide(6, "learner rank 1 died (killed)", CKPT, 4)
    assert isinstance(err, RunError)
    assert str(err) == f"learner rank 1 died (killed); resume from checkpoint {CKPT} (train.recover is off)"
    err = LearnerRecovery("off", 3, 100).decide(1, "learner rank 1 died (killed)", None, None)
    assert "no checkpoint was written" in str(err)


def test_one_more_than_max_recoveries_in_the_window_stops_the_run():
    policy = LearnerRecovery("auto", max_recoveries=2, window_steps=10)
    assert isinstance(policy.decide(3, "a", CKPT, 2), RestartPlan)
    assert isinstance(policy.decide(5, "b", CKPT, 4), RestartPlan)
    err = policy.decide(7, "learner rank 0 died (c)", CKPT, 6)
    assert isinstance(err, RunError) and "\n" not in str(err)
    assert "2 learner recoveries within 10 steps" in str(err) and CKPT in str(err)
    assert policy.recoveries == 2  # a refused recovery is not counted


def test_recoveries_older_than_the_window_no_longer_count():
    policy = LearnerRecovery("auto", max_recoveries=1, window_steps=10)
    assert isinstance(policy.decide(3, "a", None, None), RestartPlan)
    assert isinstance(policy.decide(12, "b", None, None), RunError)  # 12 - 3 < 10: still inside
    assert policy.decide(13, "c", CKPT, 12) == RestartPlan(checkpoint=CKPT, step=12, recoveries=2)


def test_window_0_counts_the_whole_run_and_max_0_never_recovers():
    policy = LearnerRecovery("auto", max_recoveries=1, window_steps=0)
    policy.decide(1, "a", None, None)
    assert isinstance(policy.decide(10_000, "b", None, None), RunError)
    assert isinstance(LearnerRecovery("auto", 0, 0).decide(0, "a", None, None), RunError)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="train.recover"):
        LearnerRecovery("sometimes", 1, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="come together"):
        LearnerRecovery("auto", 1, 1).decide(1, "a", CKPT, None)
