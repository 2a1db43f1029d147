"""Ingest throughput of the replay buffer with CURVE on and off: what encryption costs the data plane.

The real `ReplayBuffer` runs in its own process (asyncio, as in the Ray actor); one engine-like
PUSH peer in this process sends groups of `--group-size` completions of `--tokens` tokens each,
every group for a prompt the buffer leased, as fast as the socket takes them. Throughput is
groups fully decoded, checked and accepted by the buffer per second of wall time (first send to
last acceptance). On and off alternate within one run, so both see the same machine load.

    .venv/bin/python benchmarks/bench_curve.py [--groups 4000] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

import numpy as np
import zmq

from async_rl.buffer.actor import BufferSettings, ReplayBuffer
from async_rl.protocol import TrajectoryGroup, encode_groups
from async_rl.security import ClientKeys, ServerKeys, harden_client, make_run_keys

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
RUN = "bench"
PROMPT_TOKENS = 16


def buffer_process(settings: BufferSettings, groups: int, conn) -> None:
    """Child: start the buffer, lease `groups` prompts, report when all of them were accepted."""

    async def main() -> None:
        buffer = ReplayBuffer(settings)
        addresses = await buffer.start()
        prompts = await buffer.lease(engine_id=0, max_groups=groups)
        conn.send((addresses.ingest, [p.prompt_id for p in prompts]))
        want = groups * settings.group_size
        while buffer.stats().accounts.waiting < want:
            await asyncio.sleep(0.002)
        conn.send((time.perf_counter(), buffer.stats().rejected_frames))
        await buffer.close()

    asyncio.run(main())


def group(prompt_id: int, group_size: int, tokens: int, rng: np.random.Generator) -> TrajectoryGroup:
    return TrajectoryGroup(
        prompt_id=prompt_id,
        engine_id=0,
        prompt_tokens=rng.integers(0, 32000, PROMPT_TOKENS, dtype=np.int32),
        completions=[rng.integers(0, 32000, tokens, dtype=np.int32) for _ in range(group_size)],
        logprobs=[-rng.random(tokens, dtype=np.float32) for _ in range(group_size)],
        rewards=[float(i % 2) for i in range(group_size)],
        version_first=[0] * group_size,
        version_last=[0] * group_size,
        reward_status=[0] * group_size,
    )


def run_once(curve: bool, groups: int, group_size: int, tokens: int) -> dict:
    keys = make_run_keys() if curve else None
    server: ServerKeys | None = keys.server if keys else None
    client: ClientKeys | None = keys.engine if keys else None
    settings = BufferSettings(
        run_id=RUN, host="127.0.0.1", ingest_port=0, serve_port=0, max_lag=1, prompts_per_step=groups,
        group_size=group_size, filter_uniform_groups=False, max_frame_bytes=64 << 20, task_name="repeat",
        task_seed=0, curve=server,
    )
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=buffer_process, args=(settings, groups, child), daemon=True)
    proc.start()
    address, prompt_ids = parent.recv()
    rng = np.random.default_rng(0)
    frames = [encode_groups(RUN, [group(pid, group_size, tokens, rng)]) for pid in prompt_ids]
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    harden_client(push, client)
    push.connect(address)
    # The handshake (and CURVE's key exchange) is a one-off per connection: not part of the rate.
    monitor = push.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    monitor.recv_multipart()
    t0 = time.perf_counter()
    for f in frames:
        push.send_multipart(f, copy=False)
    t_done, rejected = parent.recv()
    proc.join(30)
    ctx.destroy(linger=0)
    assert not rejected, rejected
    seconds = t_done - t0
    nbytes = sum(len(p) for f in frames for p in f)
    return {
        "curve": curve,
        "groups_per_s": groups / seconds,
        "tokens_per_s": groups * group_size * tokens / seconds,
        "mb_per_s": nbytes / seconds / 1e6,
        "frame_kb": nbytes / groups / 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=4000)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256, help="completion tokens per sample")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="500 groups, 1 repeat (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.groups, args.repeats = 500, 1
    load_at_start = os.getloadavg()[0]  # this machine may be shared: keep the load with the numbers
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.repeats):
        for curve in (False, True):
            runs[curve].append(run_once(curve, args.groups, args.group_size, args.tokens))
            print(runs[curve][-1], flush=True)
    rows = []
    for curve, rs in runs.items():
        gps = [r["groups_per_s"] for r in rs]
        rows.append({
            "curve": curve,
            "groups_per_s_median": statistics.median(gps),
            "groups_per_s_min": min(gps),
            "groups_per_s_max": max(gps),
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rs),
            "mb_per_s_median": statistics.median(r["mb_per_s"] for r in rs),
            "frame_kb": rs[0]["frame_kb"],
        })
    off, on = rows
    print(f"\n{args.groups} groups of {args.group_size} x {args.tokens} tokens ({off['frame_kb']:.1f} kB a frame), "
          f"{args.repeats} repeat(s)")
    print(f"{'curve':>6} {'groups/s (min/med/max)':>26} {'tokens/s':>12} {'MB/s':>8}")
    for r in rows:
        print(f"{'on' if r['curve'] else 'off':>6} {r['groups_per_s_min']:8.0f}/{r['groups_per_s_median']:7.0f}/"
              f"{r['groups_per_s_max']:7.0f} {r['tokens_per_s_median']:12.0f} {r['mb_per_s_median']:8.1f}")
    print(f"CURVE on / off: {on['groups_per_s_median'] / off['groups_per_s_median']:.2f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "curve.json"
    out.write_text(json.dumps({"args": vars(args), "load_avg_1m_at_start": load_at_start, "rows": rows, "runs": {str(k): v for k, v in runs.items()}}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
