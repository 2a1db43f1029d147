"""The teacher's log-probs on the wire (on-policy distillation): an optional fourth part, raw float32,
present exactly when a sample is marked scored, checked at decode."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from async_rl.protocol import FrameError, GroupsHeader, decode_groups, encode_groups
from tests.unit.test_protocol import RUN, group_a, group_b


def scored_a():
    g = group_a()
    # sample 0 scored, sample 1 not (its teacher call failed: it travels without)
    g.teacher_logprobs = [np.array([-0.75, -2.5], dtype=np.float32), None]
    return g


def test_teacher_logprobs_round_trip_exactly():
    parts = encode_groups(RUN, [scored_a(), group_b()])
    assert len(parts) == 4
    assert np.frombuffer(parts[3], "<f4").tolist() == [-0.75, -2.5]  # only the scored sample's tokens
    _, (a, b) = decode_groups(parts, RUN)
    assert a.teacher_logprob(0).tolist() == [-0.75, -2.5]
    assert a.teacher_logprob(1) is None
    assert b.teacher_logprobs is None and b.teacher_logprob(2) is None
    assert [s.teacher_scored for s in msgspec.msgpack.decode(parts[0], type=GroupsHeader).groups[0].samples] == [True, False]


def test_frame_without_teacher_keeps_three_parts():
    assert len(encode_groups(RUN, [group_a(), group_b()])) == 3


def reason(parts: list[bytes]) -> str:
    with pytest.raises(FrameError) as exc:
        decode_groups(parts, RUN)
    return exc.value.reason


def test_teacher_part_missing_or_unannounced_is_rejected():
    parts = encode_groups(RUN, [scored_a()])
    assert reason(parts[:3]) == "frame_count"  # header marks a scored sample, no part [3]
    plain = encode_groups(RUN, [group_a()])
    assert reason([*plain, parts[3]]) == "frame_count"  # part [3] no sample claims


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (np.array([-1.0], "<f4").tobytes(), "length_mismatch"),  # one value for two tokens
        (np.array([-1.0, -1.0, -1.0], "<f4").tobytes(), "length_mismatch"),
        (b"\x00\x00\x80", "buffer_size"),
        (np.array([-1.0, np.nan], "<f4").tobytes(), "bad_value"),
        (np.array([-1.0, 0.5], "<f4").tobytes(), "bad_value"),  # a log-probability above 0
    ],
)
def test_bad_teacher_part_is_rejected_with_its_reason(body, why):
    parts = encode_groups(RUN, [scored_a()])
    assert reason([*parts[:3], body]) == why
