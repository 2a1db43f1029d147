"""MoE routes on the wire: exact round trips (uint8 and uint16, missing rows), and every malformed
routes part rejected with the counted reason `bad_routes` (or `frame_count` for a missing part)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from async_rl.protocol import (
    REWARD_OK,
    FrameError,
    GroupsHeader,
    RouteLayout,
    TrajectoryGroup,
    decode_groups,
    encode_groups,
    route_dtype,
    route_missing,
    route_rows,
)

RUN = "run-r"
LAYERS, TOP_K = 3, 2


def routes_for(prompt_len: int, completion_len: int, experts: int, seed: int, missing_rows=()) -> np.ndarray:
    """Distinct experts per (token, layer), as a router's top-k gives them."""
    rng = np.random.default_rng(seed)
    rows = route_rows(prompt_len, completion_len)
    r = np.stack([[rng.choice(experts, TOP_K, replace=False) for _ in range(LAYERS)] for _ in range(rows)])
    r = r.reshape(rows, LAYERS, TOP_K).astype(route_dtype(experts))
    r[list(missing_rows)] = route_missing(r.dtype)
    return r


def routed_group(prompt_id: int = 3, experts: int = 8, missing_rows=()) -> TrajectoryGroup:
    prompt = np.array([5, 6, 7, 8], np.int32)
    comps = [np.array([1, 2, 3], np.int32), np.array([4], np.int32)]
    return TrajectoryGroup(
        prompt_id=prompt_id,
        engine_id=0,
        prompt_tokens=prompt,
        completions=comps,
        logprobs=[np.full(len(c), -0.5, np.float32) for c in comps],
        rewards=[1.0, 0.0],
        version_first=[0, 0],
        version_last=[0, 0],
        reward_status=[REWARD_OK, REWARD_OK],
        routes=[routes_for(len(prompt), len(c), experts, i, missing_rows) for i, c in enumerate(comps)],
    )


def plain_group(prompt_id: int = 4) -> TrajectoryGroup:
    g = routed_group(prompt_id)
    g.routes = None
    return g


def reject(parts: list[bytes], reason: str = "bad_routes") -> FrameError:
    with pytest.raises(FrameError) as info:
        decode_groups(parts, RUN)
    assert info.value.reason == reason, str(info.value)
    return info.value


def with_header(parts: list[bytes], **changes) -> list[bytes]:
    header = msgspec.structs.replace(msgspec.msgpack.decode(parts[0], type=GroupsHeader), **changes)
    return [msgspec.msgpack.encode(header), *parts[1:]]


@pytest.mark.parametrize("experts", [8, 254, 255, 300])
def test_round_trip_is_exact_in_either_dtype(experts):
    g = routed_group(experts=experts, missing_rows=(0, 3))
    parts = encode_groups(RUN, [g, plain_group()])
    assert len(parts) == 4
    header, (back, plain) = decode_groups(parts, RUN)
    assert header.routes == RouteLayout(LAYERS, TOP_K, 1 if experts < 255 else 2)
    assert plain.routes is None
    for want, got in zip(g.routes, back.routes, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    assert (back.routes[0][3] == route_missing(back.routes[0].dtype)).all()  # a missing row stays missing


def test_rows_are_prompt_plus_completion_minus_one():
    g = routed_group()
    assert [len(r) for r in g.routes] == [4 + 3 - 1, 4 + 1 - 1]
    _, (back,) = decode_groups(encode_groups(RUN, [g]), RUN)
    assert [len(r) for r in back.routes] == [6, 4]


def test_frames_without_routes_keep_three_parts():
    parts = encode_groups(RUN, [plain_group()])
    assert len(parts) == 3
    header, (back,) = decode_groups(parts, RUN)
    assert header.routes is None and back.routes is None


def test_encoder_refuses_routes_off_the_contract():
    g = routed_group()
    g.routes[1] = g.routes[1][:-1]  # a row short
    with pytest.raises(ValueError, match="prompt 3 sample 1"):
        encode_groups(RUN, [g])
    g = routed_group()
    g.routes[0] = g.routes[0].astype(np.int32)
    with pytest.raises(ValueError, match="uint8/uint16"):
        encode_groups(RUN, [g])
    wide = routed_group(prompt_id=9)
    wide.routes = [np.concatenate([r, r], axis=1) for r in wide.routes]  # 6 layers beside 3
    with pytest.raises(ValueError, match="in one frame"):
        encode_groups(RUN, [routed_group(), wide])


def test_routes_part_missing_or_unexpected_is_frame_count():
    parts = encode_groups(RUN, [routed_group()])
    reject(parts[:3], "frame_count")
    reject([*encode_groups(RUN, [plain_group()]), parts[3]], "frame_count")


def test_routes_part_of_the_wrong_size():
    parts = encode_groups(RUN, [routed_group()])
    reject([*parts[:3], parts[3][:-1]])
    reject([*parts[:3], parts[3] + b"\x00" * (LAYERS * TOP_K)])  # one row too many


@pytest.mark.parametrize("layout", [RouteLayout(0, TOP_K, 1), RouteLayout(LAYERS, 0, 1), RouteLayout(LAYERS, TOP_K, 4)])
def test_bad_layout(layout):
    reject(with_header(encode_groups(RUN, [routed_group()]), routes=layout))


def test_layout_that_disagrees_with_the_bytes():
    parts = encode_groups(RUN, [routed_group()])  # 3 layers x top-2 x 1 byte
    reject(with_header(parts, routes=RouteLayout(LAYERS + 1, TOP_K, 1)))
    reject(with_header(parts, routes=RouteLayout(LAYERS, TOP_K, 2)))


def test_routed_group_without_a_layout_and_layout_without_a_routed_group():
    parts = encode_groups(RUN, [routed_group()])
    reject(with_header(parts, routes=None)[:3])
    header = msgspec.msgpack.decode(parts[0], type=GroupsHeader)
    header.groups[0].routed = False
    reject([msgspec.msgpack.encode(header), *parts[1:]])


def test_row_mixing_recorded_and_missing_experts():
    g = routed_group()
    g.routes[1][2, 1, 0] = route_missing(g.routes[1].dtype)
    err = reject(encode_groups(RUN, [g]))
    assert "prompt 3" in str(err)


def test_expert_twice_in_one_top_k():
    g = routed_group()
    g.routes[0][1, 0, 1] = g.routes[0][1, 0, 0]
    reject(encode_groups(RUN, [g]))


def test_rejected_routes_frame_still_names_its_prompts():
    g = routed_group(prompt_id=42)
    g.routes[0][0, 0, 1] = g.routes[0][0, 0, 0]
    err = reject(encode_groups(RUN, [g]))
    assert err.header is not None and [m.prompt_id for m in err.header.groups] == [42]
