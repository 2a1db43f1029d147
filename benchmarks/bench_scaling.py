"""Scaling: a real generator pool of 1 and 2 vLLM engines, and the buffer's control and data plane
under 64 to 256 producer processes.

Part 1 (generation): the real `GeneratorPool` (Ray actors, vLLM engines pinned to their own cores)
streaming into the real `ReplayBuffer` actor with no learner (admission sized so it never closes).
Samples/s and tokens/s over a steady window after a warm-up, for 1 engine on 1 core and 2 engines
on 1 core each; the ratio shows how close the pool comes to linear.

Part 2 (control plane): N producer processes (64, 128, 256) push recorded trajectories (exactly the
frames an engine sends: one 256-token trajectory per frame) into the real `ReplayBuffer` running as a
Ray actor, each at a fixed rate, for a sweep of offered rates. Prompts are leased beforehand, in one
Ray call per producer, as engines lease them. The producers are pinned to the last core by default
(`--producer-cores`), so that on a small machine they do not starve the buffer of CPU (the
scheduler would give it ~1/N of the cores against N busy producers). While they push, this process plays the controller and
makes a `stats` call every 50 ms: its latency is what the training loop would feel. Reported per
point: offered and accepted trajectories/s, mean ingest latency (Little's law: frames sent but not
yet accepted / accepted rate), the control-call latency p50/p99, and the buffer process's CPU use.

    python benchmarks/bench_scaling.py [--quick] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO))

from async_rl.protocol import TrajectoryGroup, encode_groups  # noqa: E402

TOKENS = 256
_MP = mp.get_context("forkserver")


# ---- part 1: generation with a real pool ---------------------------------------------------------


def generation(engines: int, warmup_s: float, window_s: float, quick: bool) -> dict:
    import ray

    from async_rl.buffer.actor import ReplayBuffer
    from async_rl.cluster.placement import plan_placement
    from async_rl.config import load_config
    from async_rl.control import settings
    from async_rl.generator.pool import GeneratorPool
    from async_rl.models.tiny import resolve_model_path
    from async_rl.security import make_run_keys

    max_tokens = 16 if quick else 64
    cfg = load_config(REPO / "configs" / "quickstart.yaml", [
        "model.path=tiny-qwen2-wide", f"generators.num_engines={engines}", "generators.cpus_per_engine=1",
        f"generators.max_tokens={max_tokens}", f"generators.max_model_len={max_tokens + 16}",
        "generators.ignore_eos=true", "generators.max_inflight_prompts=16", "train.max_lag=0",
        "train.prompts_per_step=1000000",  # admission never closes: no learner in this test
    ])
    plan = plan_placement(cfg)
    model_dir = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    run_id = uuid.uuid4().hex[:12]
    keys = make_run_keys()  # CURVE on, as in a real run
    buffer = ray.remote(ReplayBuffer).options(num_cpus=0).remote(settings.buffer_settings(cfg, run_id, keys, model_dir))
    addresses = ray.get(buffer.start.remote())
    pool = GeneratorPool(
        lambda i: settings.engine_settings(cfg, run_id, model_dir, plan, i, addresses.ingest, keys),
        buffer, 1, 1, cfg.weight_sync.timeout_s,
    )
    try:
        pool.add(engines, paused=False)
        time.sleep(warmup_s)
        s0, t0 = pool.stats(), time.perf_counter()
        time.sleep(window_s)
        s1, t1 = pool.stats(), time.perf_counter()
    finally:
        pool.shutdown()
        ray.get(buffer.close.remote())
        ray.kill(buffer)
    wall = t1 - t0
    samples = sum(b.samples_pushed - a.samples_pushed for a, b in zip(s0, s1, strict=True))
    tokens = sum(b.tokens_generated - a.tokens_generated for a, b in zip(s0, s1, strict=True))
    return {"engines": engines, "cores": [p.cores for p in plan.engines], "samples_per_s": samples / wall,
            "tokens_per_s": tokens / wall, "max_tokens": max_tokens}


# ---- part 2: many producers into the real buffer -------------------------------------------------


def recorded_group(prompt_id: int, engine_id: int) -> TrajectoryGroup:
    rng = np.random.default_rng(prompt_id)
    return TrajectoryGroup(
        prompt_id=prompt_id, engine_id=engine_id, prompt_tokens=rng.integers(0, 48, 16, dtype=np.int32),
        completions=[rng.integers(0, 48, TOKENS, dtype=np.int32)], logprobs=[-rng.random(TOKENS, dtype=np.float32)],
        rewards=[0.5], version_first=[0], version_last=[0], reward_status=[0],
    )


def producer(address: str, run_id: str, engine_id: int, prompt_ids: list[int], rate: float, sent, go,
             cores: list[int]) -> None:
    import zmq

    if cores:  # keep the simulated engines off the buffer's core, as real engines on their own cores are
        os.sched_setaffinity(0, cores)

    frames = [encode_groups(run_id, [recorded_group(pid, engine_id)]) for pid in prompt_ids]  # recorded
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(address)
    go.wait()
    t_next = time.monotonic()
    for i, f in enumerate(frames):
        t_next += 1.0 / rate
        delay = t_next - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        push.send_multipart(f)  # blocks when the buffer's queue is full: the offered rate then drops
        sent[engine_id] = i + 1
    ctx.destroy(linger=0)


def control_plane(producers: int, offered: float, duration_s: float, producer_cores: list[int]) -> dict:
    import psutil
    import ray

    from async_rl.buffer.actor import BufferSettings, ReplayBuffer

    run_id = uuid.uuid4().hex[:12]
    per = max(1, int(offered / producers * duration_s))
    total = per * producers
    buffer = ray.remote(ReplayBuffer).options(num_cpus=0).remote(BufferSettings(
        run_id=run_id, host="127.0.0.1", ingest_port=0, serve_port=0, max_lag=0, prompts_per_step=total,
        group_size=1, filter_uniform_groups=False, max_frame_bytes=64 << 20, task_name="repeat", task_seed=0))
    try:
        addresses = ray.get(buffer.start.remote())
        pid = ray.get(buffer.__ray_call__.remote(lambda self: os.getpid()))
        leases = ray.get([buffer.lease.remote(i, per, 0.0) for i in range(producers)])
        sent = _MP.Array("q", producers, lock=False)
        go = _MP.Event()
        procs = [_MP.Process(target=producer, daemon=True,
                             args=(addresses.ingest, run_id, i, [p.prompt_id for p in leases[i]], offered / producers,
                                   sent, go, producer_cores)) for i in range(producers)]
        for p in procs:
            p.start()
        time.sleep(2.0 + producers * 0.02)  # every producer has encoded its frames and connected
        proc = psutil.Process(pid)
        cpu0 = sum(proc.cpu_times()[:2])
        t0 = time.monotonic()
        go.set()
        call_lat, backlog, samples = [], [], []
        while time.monotonic() - t0 < duration_s:
            c0 = time.monotonic()
            stats = ray.get(buffer.stats.remote())
            now = time.monotonic()
            call_lat.append(now - c0)
            accepted = stats.accounts.waiting
            backlog.append(sum(sent) - accepted)
            samples.append((now - t0, sum(sent), accepted))
            time.sleep(max(0.0, 0.05 - (time.monotonic() - c0)))
        t1 = time.monotonic()
        cpu = sum(proc.cpu_times()[:2]) - cpu0
        final = ray.get(buffer.stats.remote())
        go.clear()
        for p in procs:
            p.terminate()
        for p in procs:
            p.join()
    finally:
        ray.get(buffer.close.remote())
        ray.kill(buffer)
    wall = t1 - t0
    # Over the whole window: accepted <= sent <= offered, and a buffer that falls behind shows as a
    # growing backlog (a half-window rate could exceed the offered rate while a backlog drains).
    _, sent_total, accepted_total = samples[-1]
    acc_rate = accepted_total / samples[-1][0]
    sent_rate = sent_total / samples[-1][0]
    mean_backlog = statistics.mean(backlog[len(backlog) // 2:])
    return {
        "producers": producers, "offered_per_s": offered, "sent_per_s": sent_rate, "accepted_per_s": acc_rate,
        "ingest_latency_ms": 1e3 * mean_backlog / acc_rate if acc_rate else float("inf"),
        "control_call_p50_ms": 1e3 * float(np.percentile(call_lat, 50)),
        "control_call_p99_ms": 1e3 * float(np.percentile(call_lat, 99)),
        "buffer_cpu_frac": cpu / wall, "rejected": sum(final.rejected_frames.values()),
    }


def plot(gen: list[dict], cp: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    if gen:
        a1.bar([f"{g['engines']} engine(s)" for g in gen], [g["tokens_per_s"]["median"] for g in gen], color="#3a7")
        a1.set_ylabel("tokens/s (median)")
        a1.set_title("generator pool (1 core per engine)")
    for n in sorted({r["producers"] for r in cp}):
        pts = sorted((r["offered_per_s"], r["accepted_per_s"]["median"]) for r in cp if r["producers"] == n)
        a2.plot([p for p, _ in pts], [v for _, v in pts], marker="o", label=f"{n} producers")
    if cp:
        top = max(r["offered_per_s"] for r in cp)
        a2.plot([0, top], [0, top], "k:", label="accepted = offered")
        a2.set_xlabel("offered trajectories/s")
        a2.set_ylabel("accepted trajectories/s (median)")
        a2.set_title(f"buffer ingest, {TOKENS}-token trajectories")
        a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def med(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one repetition, short windows, fewer points")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--producers", default="64,128,256")
    ap.add_argument("--offered", default="5000,10000,20000,40000", help="offered trajectories/s to sweep")
    ap.add_argument("--skip-generation", action="store_true")
    ap.add_argument("--producer-cores", default="last",
                    help="cores the producer processes are pinned to: 'last' (the last core; the buffer keeps "
                         "the others), 'all' (unpinned: on 2 cores they then starve the buffer), or a list '1,2'")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    out = args.out or ("scaling-quick" if args.quick else "scaling")
    repeats = 1 if args.quick else args.repeats
    producer_counts = [64] if args.quick else [int(x) for x in args.producers.split(",")]
    offered = [2000, 8000] if args.quick else [float(x) for x in args.offered.split(",")]
    duration = 2.0 if args.quick else 6.0
    all_cores = sorted(os.sched_getaffinity(0))
    if args.producer_cores == "all":
        producer_cores: list[int] = []
    elif args.producer_cores == "last":
        producer_cores = all_cores[-1:] if len(all_cores) > 1 else []
    else:
        producer_cores = [int(c) for c in args.producer_cores.split(",")]

    _MP.set_forkserver_preload(["__main__", "numpy", "zmq", "async_rl.protocol"])
    p = _MP.Process(target=time.sleep, args=(0,))  # the fork server starts before Ray's threads do
    p.start()
    p.join()
    import ray

    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("RAY_TMPDIR", tmp)
        ray.init(num_cpus=len(os.sched_getaffinity(0)), include_dashboard=False, logging_level=logging.WARNING,
                 log_to_driver=False, object_store_memory=200 << 20,
                 runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "VLLM_LOGGING_LEVEL": "WARNING"}})
        gen_rows, cp_rows = [], []
        try:
            if not args.skip_generation:
                for engines in (1, 2):
                    runs = [generation(engines, 10.0 if args.quick else 20.0, 10.0 if args.quick else 30.0, args.quick)
                            for _ in range(repeats)]
                    gen_rows.append({"engines": engines, "cores": runs[0]["cores"], "max_tokens": runs[0]["max_tokens"],
                                     "samples_per_s": med([r["samples_per_s"] for r in runs]),
                                     "tokens_per_s": med([r["tokens_per_s"] for r in runs]), "runs": runs})
                    t = gen_rows[-1]["tokens_per_s"]
                    print(f"generation: {engines} engine(s) on cores {runs[0]['cores']}: tokens/s "
                          f"{t['min']:.0f}/{t['median']:.0f}/{t['max']:.0f} (min/med/max)", flush=True)
                if len(gen_rows) == 2:
                    print(f"2 engines / 1 engine: {gen_rows[1]['tokens_per_s']['median'] / gen_rows[0]['tokens_per_s']['median']:.2f}x",
                          flush=True)
            print(f"\n{'producers':>9} {'offered/s':>10} {'sent/s':>9} {'accepted/s min/med/max':>26} {'ingest lat ms':>14} "
                  f"{'ctl p50/p99 ms':>15} {'buffer CPU':>10}", flush=True)
            for n in producer_counts:
                for rate in offered:
                    runs = [control_plane(n, rate, duration, producer_cores) for _ in range(repeats)]
                    row = {"producers": n, "offered_per_s": rate,
                           "sent_per_s": statistics.median(r["sent_per_s"] for r in runs),
                           "accepted_per_s": med([r["accepted_per_s"] for r in runs]),
                           "ingest_latency_ms": statistics.median(r["ingest_latency_ms"] for r in runs),
                           "control_call_p50_ms": statistics.median(r["control_call_p50_ms"] for r in runs),
                           "control_call_p99_ms": statistics.median(r["control_call_p99_ms"] for r in runs),
                           "buffer_cpu_frac": statistics.median(r["buffer_cpu_frac"] for r in runs),
                           "rejected": sum(r["rejected"] for r in runs), "runs": runs}
                    cp_rows.append(row)
                    a = row["accepted_per_s"]
                    print(f"{n:>9} {rate:>10.0f} {row['sent_per_s']:>9.0f} {a['min']:8.0f}/{a['median']:8.0f}/{a['max']:8.0f} "
                          f"{row['ingest_latency_ms']:>14.1f} {row['control_call_p50_ms']:>7.1f}/{row['control_call_p99_ms']:<7.1f} "
                          f"{row['buffer_cpu_frac']:>10.0%}", flush=True)
        finally:
            ray.shutdown()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{out}.json").write_text(json.dumps(
        {"repeats": repeats, "duration_s": duration, "tokens": TOKENS, "cores": len(all_cores),
         "producer_cores": producer_cores or "all",
         "generation": gen_rows, "control_plane": cp_rows}, indent=2))
    plot(gen_rows, cp_rows, RESULTS / f"{out}.png")
    print(f"wrote {RESULTS / (out + '.json')} and .png")


if __name__ == "__main__":
    main()
