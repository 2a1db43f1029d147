"""Checks on a run's metrics records that can fail: each accounting bucket against what the test
did, and admission control against AReaL's limit (not `lag_max <= max_lag`, which holds after the
buffer already dropped whatever was staler, nor `accounting_balanced` alone, which a bug that moves
samples into the wrong bucket keeps balanced)."""

from __future__ import annotations


def check_admission(records: list[dict], max_lag: int, batch: int) -> None:
    """Staleness was bounded at the source: no sample had to be dropped as stale, and at every step
    the samples admitted (leased and not dropped, filtered, lost or requeued) stayed within
    (max_lag + generator_version + 1) * batch, the limit at the newest version leases were made."""
    for r in records:
        assert r["dropped_stale"] == 0, r
        admitted = r["leased"] - r["dropped_stale"] - r["filtered"] - r["lost"] - r["requeued"]
        assert admitted <= (max_lag + r["generator_version"] + 1) * batch, r


def check_buckets(
    records: list[dict], batch: int, first_step: int = 0, *, lost: int = 0, filtered: int = 0, requeued: int = 0
) -> None:
    """Every bucket per step: `batch` more trained per step; nothing lost, filtered or requeued unless
    the test caused it (the counts given are upper bounds at the last step, and exact there); the
    rest of what was leased is in flight or waiting."""
    for i, r in enumerate(records):
        assert r["trained"] == batch * (first_step + i + 1), r
        assert r["in_flight"] >= 0 and r["waiting"] >= 0, r
        assert r["leased"] == r["in_flight"] + r["waiting"] + r["trained"] + r["dropped_stale"] + r["filtered"] + (
            r["lost"] + r["requeued"]
        ), r
        assert r["lost"] <= lost and r["filtered"] <= filtered and r["requeued"] <= requeued, r
    last = records[-1]
    assert (last["lost"], last["filtered"], last["requeued"]) == (lost, filtered, requeued), last
