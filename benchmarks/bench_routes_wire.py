"""Routes on the wire: frame size, bytes a token, encode and decode(+check) time of one group of 8
samples (200 prompt + 800 completion tokens each) without routes, with Qwen3-30B-A3B-shaped routes (48
MoE layers x top-8, uint8) and with the tiny presets' (2 x top-2).

Run: PYTHONPATH=. python benchmarks/bench_routes_wire.py
"""

from __future__ import annotations

import time

import numpy as np

from async_rl.protocol import TrajectoryGroup, decode_groups, encode_groups

PROMPT, COMPLETION, SAMPLES, REPS = 200, 800, 8, 20


def group(layers: int, top_k: int, routed: bool) -> TrajectoryGroup:
    rng = np.random.default_rng(0)
    comps = [rng.integers(0, 1000, COMPLETION, dtype=np.int32) for _ in range(SAMPLES)]
    g = TrajectoryGroup(
        0, 0, rng.integers(0, 1000, PROMPT, dtype=np.int32), comps, [np.full(COMPLETION, -0.5, np.float32)] * SAMPLES,
        [0.0] * SAMPLES, [0] * SAMPLES, [0] * SAMPLES, [0] * SAMPLES,
    )
    if routed:
        rows = PROMPT + COMPLETION - 1
        g.routes = [np.argsort(rng.random((rows, layers, 128)), -1)[..., :top_k].astype(np.uint8)] * SAMPLES
    return g


def timed(call) -> float:
    t0 = time.perf_counter()
    for _ in range(REPS):
        call()
    return (time.perf_counter() - t0) / REPS


if __name__ == "__main__":
    tokens = PROMPT + SAMPLES * COMPLETION
    for layers, top_k, routed in [(48, 8, False), (48, 8, True), (2, 2, True)]:
        g = group(layers, top_k, routed)
        parts = encode_groups("r", [g])
        size = sum(len(p) for p in parts)
        enc = timed(lambda g=g: encode_groups("r", [g]))
        dec = timed(lambda parts=parts: decode_groups(parts, "r"))
        print(
            f"layers={layers} top_k={top_k} routed={routed}: frame {size / 1e6:.2f} MB, {size / tokens:.0f} B/token, "
            f"encode {enc * 1e3:.1f} ms, decode+check {dec * 1e3:.1f} ms ({1 / dec:.0f} groups/s)"
        )
