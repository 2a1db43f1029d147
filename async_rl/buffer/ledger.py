"""Admission control and exact sample accounting: pure logic, no sockets.

Every leased sample ends in exactly one state, and the states always add up to what was leased:

    leased == in_flight + waiting + trained + dropped_stale + filtered + lost + requeued

`leased` counts leases, not prompts: a lease handed back (its engine drained or died) is counted
`requeued` and its prompt goes back to the pool, where a later lease takes it again.

Admission follows AReaL's rule, counted in samples: a new lease is allowed only while

    admitted + new <= (max_lag + generator_version + replayed_steps + 1) * batch_samples

where admitted = leased - dropped_stale - filtered - lost - requeued (samples that will be, or were, trained).
So a sample leased while the generators hold version v is trained at a step <= v + max_lag.
`replayed_steps`: steps trained again after a learner recovery (supervisor.py) went back to a
checkpoint; their batches are trained (admitted) too, although the version they lead to was reached before.
"""

from __future__ import annotations

import msgspec


class Accounts(msgspec.Struct, kw_only=True):
    leased: int = 0
    in_flight: int = 0
    waiting: int = 0
    trained: int = 0
    dropped_stale: int = 0
    filtered: int = 0
    lost: int = 0
    requeued: int = 0

    def balanced(self) -> bool:
        return self.leased == (
            self.in_flight
            + self.waiting
            + self.trained
            + self.dropped_stale
            + self.filtered
            + self.lost
            + self.requeued
        )


class Ledger:
    def __init__(self, max_lag: int, batch_samples: int, group_size: int) -> None:
        self.max_lag = max_lag
        self.batch_samples = batch_samples
        self.group_size = group_size
        self.generator_version = 0
        self.replayed_steps = 0  # steps a restarted learner trains again (see the module doc)
        self.accounts = Accounts()

    @property
    def admitted(self) -> int:
        a = self.accounts
        return a.leased - a.dropped_stale - a.filtered - a.lost - a.requeued

    def capacity_groups(self) -> int:
        """How many more prompt groups may be leased now."""
        limit = (self.max_lag + self.generator_version + self.replayed_steps + 1) * self.batch_samples
        return max(0, (limit - self.admitted) // self.group_size)

    def lease(self, groups: int) -> int:
        """Lease up to `groups` groups; returns how many were granted."""
        granted = min(groups, self.capacity_groups())
        self.accounts.leased += granted * self.group_size
        self.accounts.in_flight += granted * self.group_size
        return granted

    def arrived(self, samples: int) -> None:
        self.accounts.in_flight -= samples
        self.accounts.waiting += samples

    def arrived_filtered(self, samples: int) -> None:
        self.accounts.in_flight -= samples
        self.accounts.filtered += samples

    def trained(self, samples: int) -> None:
        """The learner acknowledged a batch holding these samples (not merely fetched it)."""
        self.accounts.waiting -= samples
        self.accounts.trained += samples

    def lost_waiting(self, samples: int) -> None:
        """Arrived samples that will never be trained: their batch went to a learner that died."""
        self.accounts.waiting -= samples
        self.accounts.lost += samples

    def dropped_stale(self, samples: int) -> None:
        self.accounts.waiting -= samples
        self.accounts.dropped_stale += samples

    def lost(self, samples: int) -> None:
        """Leased samples that will never arrive (engine died, run ended)."""
        self.accounts.in_flight -= samples
        self.accounts.lost += samples

    def requeued_lease(self, samples: int) -> None:
        """A lease handed back unfinished (engine drained or died): its prompt is leased again later."""
        self.accounts.in_flight -= samples
        self.accounts.requeued += samples

    @staticmethod
    def is_stale(oldest_version: int, learner_version: int, max_lag: int) -> bool:
        return learner_version - oldest_version > max_lag
