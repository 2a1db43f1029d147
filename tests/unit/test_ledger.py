"""Admission control (AReaL's staleness rule) and exact sample accounting."""

from __future__ import annotations

import random

import pytest

from async_rl.buffer.ledger import Accounts, Ledger


def test_fresh_ledger():
    led = Ledger(max_lag=1, batch_samples=16, group_size=4)
    assert led.accounts == Accounts()
    assert led.accounts.balanced()
    assert led.admitted == 0
    # (max_lag + v + 1) * batch - admitted = (1 + 0 + 1) * 16 - 0 = 32 samples = 8 groups
    assert led.capacity_groups() == 8


def test_capacity_follows_the_rule():
    led = Ledger(max_lag=1, batch_samples=16, group_size=4)
    assert led.lease(3) == 3
    assert led.accounts.leased == 12 and led.accounts.in_flight == 12
    assert led.capacity_groups() == (32 - 12) // 4 == 5
    assert led.lease(10) == 5  # only what fits
    assert led.capacity_groups() == 0
    assert led.lease(1) == 0
    assert led.accounts.leased == 32
    led.generator_version = 1  # (1 + 1 + 1) * 16 - 32 = 16 samples
    assert led.capacity_groups() == 4
    led.generator_version = 3  # (1 + 3 + 1) * 16 - 32 = 48 samples
    assert led.capacity_groups() == 12


@pytest.mark.parametrize("max_lag, version, admitted_groups", [(0, 0, 0), (2, 0, 5), (0, 4, 7), (3, 2, 0)])
def test_capacity_formula(max_lag, version, admitted_groups):
    led = Ledger(max_lag=max_lag, batch_samples=12, group_size=3)
    led.generator_version = version
    assert led.lease(admitted_groups) == admitted_groups
    assert led.capacity_groups() == ((max_lag + version + 1) * 12 - admitted_groups * 3) // 3


def test_capacity_counts_whole_groups_only():
    # batch of 10 samples, groups of 4: 2 groups (8 samples) fit, a third would overshoot to 12
    led = Ledger(max_lag=0, batch_samples=10, group_size=4)
    assert led.capacity_groups() == 2
    assert led.lease(3) == 2
    assert led.capacity_groups() == 0  # 2 samples left: not a whole group


def test_lease_zero():
    led = Ledger(max_lag=1, batch_samples=8, group_size=4)
    assert led.lease(0) == 0
    assert led.accounts == Accounts()


def test_max_lag_zero_is_synchronous():
    group, prompts = 4, 2
    batch = group * prompts
    led = Ledger(max_lag=0, batch_samples=batch, group_size=group)
    for version in range(3):
        # exactly one batch may be leased for the current version
        assert led.capacity_groups() == prompts
        assert led.lease(prompts + 3) == prompts
        assert led.capacity_groups() == 0
        led.arrived(batch)
        assert led.capacity_groups() == 0  # arrival frees nothing: those samples will be trained
        led.trained(batch)
        assert led.capacity_groups() == 0  # nor does training, until the weights move on
        assert led.accounts.trained == batch * (version + 1)
        led.generator_version = version + 1
    assert led.capacity_groups() == prompts
    assert led.accounts.balanced()


def test_one_step_off_policy_allows_one_batch_ahead():
    led = Ledger(max_lag=1, batch_samples=8, group_size=4)
    assert led.lease(100) == 4  # two batches at version 0
    led.arrived(8)
    led.trained(8)  # step 0 done
    assert led.capacity_groups() == 0
    led.generator_version = 1
    assert led.lease(100) == 2  # one more batch


def test_filtered_samples_free_capacity():
    led = Ledger(max_lag=0, batch_samples=8, group_size=4)
    assert led.lease(2) == 2
    led.arrived_filtered(4)
    assert led.accounts.filtered == 4 and led.accounts.in_flight == 4
    assert led.admitted == 4
    assert led.capacity_groups() == 1
    assert led.accounts.balanced()


def test_lost_samples_free_capacity():
    led = Ledger(max_lag=0, batch_samples=8, group_size=4)
    assert led.lease(2) == 2
    led.lost(8)
    assert led.accounts.lost == 8 and led.accounts.in_flight == 0
    assert led.admitted == 0
    assert led.capacity_groups() == 2
    assert led.accounts.balanced()


def test_dropped_stale_samples_free_capacity():
    led = Ledger(max_lag=0, batch_samples=8, group_size=4)
    assert led.lease(2) == 2
    led.arrived(8)
    led.dropped_stale(4)
    assert led.accounts.waiting == 4 and led.accounts.dropped_stale == 4
    assert led.admitted == 4
    assert led.capacity_groups() == 1
    assert led.accounts.balanced()


def test_trained_samples_do_not_free_capacity():
    led = Ledger(max_lag=0, batch_samples=8, group_size=4)
    led.lease(2)
    led.arrived(8)
    led.trained(8)
    assert led.admitted == 8
    assert led.capacity_groups() == 0


def test_accounts_balanced_detects_a_leak():
    a = Accounts(leased=10, in_flight=2, waiting=2, trained=2, dropped_stale=2, filtered=1, lost=1)
    assert a.balanced()
    assert not Accounts(leased=10, in_flight=2, waiting=2, trained=2, dropped_stale=2, filtered=1).balanced()
    assert not Accounts(in_flight=1).balanced()


def test_balanced_after_every_operation_in_random_sequences():
    rng = random.Random(2024)
    for trial in range(20):
        group = rng.choice([1, 2, 4, 8])
        batch = group * rng.randint(1, 4)
        max_lag = rng.randint(0, 3)
        led = Ledger(max_lag=max_lag, batch_samples=batch, group_size=group)
        # in-flight and waiting are tracked in whole groups, as the buffer does
        inflight_groups = 0
        waiting_groups = 0
        for _ in range(400):
            op = rng.randrange(7)
            if op == 0:
                want = rng.randint(0, 5)
                cap = led.capacity_groups()
                got = led.lease(want)
                assert got == min(want, cap)
                inflight_groups += got
            elif op == 1 and inflight_groups:
                led.arrived(group)
                inflight_groups -= 1
                waiting_groups += 1
            elif op == 2 and inflight_groups:
                led.arrived_filtered(group)
                inflight_groups -= 1
            elif op == 3 and inflight_groups:
                led.lost(group)
                inflight_groups -= 1
            elif op == 4 and waiting_groups:
                led.trained(group)
                waiting_groups -= 1
            elif op == 5 and waiting_groups:
                led.dropped_stale(group)
                waiting_groups -= 1
            elif op == 6:
                led.generator_version += rng.randint(0, 1)
            a = led.accounts
            assert a.balanced(), (trial, a)
            assert a.in_flight == inflight_groups * group
            assert a.waiting == waiting_groups * group
            assert min(a.leased, a.in_flight, a.waiting, a.trained, a.dropped_stale, a.filtered, a.lost) >= 0
            # the admission bound always holds
            assert led.admitted <= (max_lag + led.generator_version + 1) * batch
            assert led.admitted == a.in_flight + a.waiting + a.trained
            assert led.capacity_groups() >= 0


@pytest.mark.parametrize(
    "oldest, learner, max_lag, stale",
    [
        (3, 3, 0, False),
        (3, 4, 0, True),
        (3, 4, 1, False),
        (3, 5, 1, True),
        (0, 2, 2, False),
        (0, 3, 2, True),
        (5, 4, 0, False),  # a sample newer than the learner is never stale
    ],
)
def test_is_stale_boundaries(oldest, learner, max_lag, stale):
    assert Ledger.is_stale(oldest, learner, max_lag) is stale


def test_admitted_sample_is_never_stale_when_trained_in_order():
    # A sample leased while generators hold version v is admitted only if it fits in the batches up
    # to step v + max_lag; training at that step with learner version v + max_lag is not stale.
    for max_lag in range(3):
        for v in range(4):
            assert not Ledger.is_stale(v, v + max_lag, max_lag)
            assert Ledger.is_stale(v, v + max_lag + 1, max_lag)


def test_replayed_steps_extend_admission_by_their_batches():
    # A learner recovery went back 2 steps: the generators' version drops from 3 to 1, but the 2
    # replayed steps' batches must still be leased, so admission counts them (ledger.py).
    led = Ledger(max_lag=1, batch_samples=16, group_size=4)
    led.generator_version = 3
    assert led.lease(100) == 20  # (1 + 3 + 1) * 16 = 80 samples admitted: full
    led.generator_version = 1  # back at the checkpoint's version
    assert led.capacity_groups() == 0
    led.replayed_steps = 2
    assert led.capacity_groups() == 0  # (1 + 1 + 2 + 1) * 16 = 80: the replayed batches are already admitted
    led.generator_version = 2
    assert led.capacity_groups() == 4  # one version on: one more batch, as without the recovery
