"""After a delta update: does every engine serve exactly the learner's weights? (weight_sync.delta)

A full update is verified as received (the chunk checksums of its bytes); a delta is also verified
as served, because a patch applied to the wrong baseline would arrive intact and still be wrong. The
caller (the generator pool) falls back to a full update for everyone when any engine disagrees.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from async_rl.weight_sync.base import UpdateReceipt
from async_rl.weight_sync.checksum import engine_checksum


class SyncOutcome(msgspec.Struct, frozen=True):
    """What the last weight sync moved, for the step's record."""

    delta: bool = False  # the update the engines resumed on came as a delta
    sent_bytes: int = 0  # bytes over the channel, the fall-back's full update included
    fell_back: bool = False  # a delta's served checksum disagreed: a full update followed


def delta_mismatches(ours: UpdateReceipt, engines: dict[int, list[UpdateReceipt]]) -> dict[int, str]:
    """engine id -> why, for every engine whose served weights after the delta update `ours` (the
    sender's receipt) are not the learner's; `engines`: each engine's receipts, one per TP worker."""
    if ours.expected is None:
        raise ValueError(f"delta update v{ours.version}: the sender's receipt carries no expected checksum")
    out: dict[int, str] = {}
    for engine_id, receipts in engines.items():
        parts = [r.served_parts for r in receipts]
        if not parts or any(p is None for p in parts):
            out[engine_id] = "its workers sent no served checksum"
            continue
        try:
            served = engine_checksum([p for p in parts if p is not None])
        except ValueError as exc:
            out[engine_id] = str(exc)
            continue
        if not served.close_to(ours.expected):
            out[engine_id] = (
                f"serves sum {served.total:.9g} / sum of squares {served.sum_sq:.9g} over {served.count} elements, "
                f"the learner {ours.expected.total:.9g} / {ours.expected.sum_sq:.9g} over {ours.expected.count}"
            )
    return out


# One update: full=True forces a full one; returns the sender's receipt and each engine's receipts.
Update = Callable[[bool], tuple[UpdateReceipt, dict[int, list[UpdateReceipt]]]]


def verified_update(update: Update, version: int, fell_back: Callable[[str], None]) -> SyncOutcome:
    """Run `update` (a delta where the sender can); after a delta, every engine must serve the learner's
    weights, else `fell_back` is told in one line (the pool counts it) and a full update follows for
    every engine (the receivers keep no baseline of their own choosing: the full update resets it)."""
    ours, engines = update(False)
    if not ours.delta:
        return SyncOutcome(delta=False, sent_bytes=ours.sent_bytes)
    bad = delta_mismatches(ours, engines)
    if not bad:
        return SyncOutcome(delta=True, sent_bytes=ours.sent_bytes)
    engine_id, why = next(iter(bad.items()))
    fell_back(f"delta update v{version}: engine {engine_id} {why}; sending a full update")
    full, _ = update(True)
    return SyncOutcome(delta=False, sent_bytes=ours.sent_bytes + full.sent_bytes, fell_back=True)
