"""Routes on the wire: frame size, bytes a token, encode and decode(+check) time of one group of 8
samples (200 prompt + 800 completion tokens each) without routes, with Qwen3-30B-A3B-shaped routes (48
MoE layers x top-8, uint8) and with the tiny presets' (2 x top-2); and what the buffer holds for 1k
such samples: 125 frames decoded (with every check) and kept as the buffer keeps its waiting groups,
measured as this process's resident memory before and after, and as the arrays' bytes.

Run: PYTHONPATH=. python benchmarks/bench_routes_wire.py [--out benchmarks/results/routes_wire.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

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


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def held_per_1k_samples(parts: list[bytes]) -> tuple[int, int]:
    """Resident bytes and array bytes of 1k samples decoded from copies of `parts` and kept (what the
    buffer's waiting groups hold): 1000 / SAMPLES frames, each decoded from its own bytes."""
    gc.collect()
    before = rss_bytes()
    frames = [[bytes(bytearray(p)) for p in parts] for _ in range(1000 // SAMPLES)]  # as received: bytes of their own
    kept = [g for f in frames for g in decode_groups(f, "r")[1]]
    del frames  # what stays alive is what the decoded groups reference (their arrays are views of it)
    gc.collect()
    arrays = sum(a.nbytes for g in kept for field in (g.completions, g.logprobs, g.routes or []) for a in field)
    arrays += sum(g.prompt_tokens.nbytes for g in kept)
    return rss_bytes() - before, arrays


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    tokens = PROMPT + SAMPLES * COMPLETION
    rows = []
    for layers, top_k, routed in [(48, 8, False), (2, 2, True), (48, 8, True)]:  # the largest last: RSS reuses freed pages
        g = group(layers, top_k, routed)
        parts = encode_groups("r", [g])
        size = sum(len(p) for p in parts)
        enc = timed(lambda g=g: encode_groups("r", [g]))
        dec = timed(lambda parts=parts: decode_groups(parts, "r"))
        held, arrays = held_per_1k_samples(parts)
        rows.append({"layers": layers, "top_k": top_k, "routed": routed, "frame_bytes": size,
                     "bytes_per_token": size / tokens, "encode_s": enc, "decode_check_s": dec,
                     "held_rss_bytes_per_1k_samples": held, "held_array_bytes_per_1k_samples": arrays})
        print(
            f"layers={layers} top_k={top_k} routed={routed}: frame {size / 1e6:.2f} MB, {size / tokens:.0f} B/token, "
            f"encode {enc * 1e3:.1f} ms, decode+check {dec * 1e3:.1f} ms ({1 / dec:.0f} groups/s); "
            f"1k samples held: {held / 1e6:.0f} MB resident, {arrays / 1e6:.0f} MB of arrays",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps({"prompt": PROMPT, "completion": COMPLETION, "samples": SAMPLES, "rows": rows}, indent=1))
