"""Cluster-scale simulation: the real buffer actor and control loop, driven by simulated GPUs.

What is REAL here: the `ReplayBuffer` Ray actor (admission control, ZMQ ingest with CURVE, batch
serving), the wire frames (`protocol.encode_groups`, msgspec header + int32 tokens + float32
log-probs of each sample's real length), one ZMQ PUSH socket with the run's engine CURVE keys per
simulated engine (`security.make_run_keys`, as real engines have), the learner ranks' real
`BatchClient`, and a controller loop of the same shape as `async_rl/control/controller.py`: train step ->
version + 1 -> weight sync (engines pause, `set_generator_version`, engines resume).

What is SIMULATED: the GPUs. Each simulated vLLM engine (an asyncio task; all of them in one
thread of this process) does continuous batching: a running set of up to `max_num_seqs` samples,
one decode step costing `sim_model.decode_step_s(B, context)` (a roofline of HBM reads and FLOPs
plus a CPU overhead), a finished group pushed at once as a real frame with random token ids and
log-probs. In-flight requests keep generating across a weight update ('keep' mode) and record
version_first / version_last. A learner step sleeps for its tokens / (GPUs x tokens/s per GPU); a
weight sync for bytes / bandwidth + a fixed cost. Prefill is not charged (prompts of 256 tokens
against completions of ~1000: about 1-2% of decode time).

Time is compressed by a factor C (simulated seconds = wall seconds x C, at most 60), chosen per
setting so that the bytes the buffer must ingest stay under `--max-mb-s` (40 MB/s). The buffer's real overheads (decode,
CURVE, Ray calls, Python) are then C times larger relative to the simulated GPUs than on a real
cluster: a conservative setting for our control plane.

Calibration (see sim_model.py for each constant; the README lists the same):
- H100 SXM: 3.35 TB/s HBM3, 989 TFLOPS dense BF16 (NVIDIA datasheet).
- Decode efficiency 77% of the HBM roofline at batch 1: vLLM, Llama-3.1-8B, measured on A100
  (johnmusgrave.com, "vLLM throughput-latency sweep on NVIDIA A100"); applied to H100 (interpolated).
  With a 2 ms per-step CPU overhead (assumed; the vLLM v0.6.0 blog, blog.vllm.ai 2024-09-05, shows
  CPU overhead dominating H100 decode before multi-step scheduling) this gives ~126 tok/s at batch
  1 and ~11k tok/s at batch 128 for a 7B model.
- Learner: 40% MFU (Megatron-LM's README reports up to 47% MFU on H100), 8N FLOPs per token
  (fwd+bwd 6N, old log-probs 2N) -> ~6.5k tokens/s per GPU for 7.6e9 parameters.
- Weight sync: 15.2 GB of bf16 over 40 GB/s (NDR 400 Gb/s at ~80%) + 1 s fixed = 1.4 s (assumed).
- Lengths: lognormal, median 600, sigma 1.0 (p99/median 10.2), cap 8192; prompts 256 tokens;
  8 samples per prompt; 8 prompts (64 samples) per GPU per step.
Published speedups to compare with: verl fully_async_policy (docs/advance/fully_async.md): 2.66x
at 32 GPUs, 1.92x at 64, 2.35x at 128 (Qwen2.5-Math-7B, H20, 28k max response, 400 steps);
AReaL (arXiv 2505.24298): up to 2.77x over synchronous systems on the same GPUs.

    python benchmarks/bench_sim.py [--quick] [--gpus 8 16 32 64 128] [--lags 0 1 2 4] [--splits 3]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import math
import os
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from sim_model import (  # noqa: E402
    Gpu,
    Lengths,
    Model,
    decode_step_s,
    decode_tokens_per_s,
    nearby_splits,
    split_gpus,
    sync_s,
    train_tokens_per_s,
)

from async_rl.protocol import TrajectoryGroup, encode_groups  # noqa: E402

PROMPT_TOKENS = 256
GROUP = 8
MAX_NUM_SEQS = 256
BYTES_PER_TOKEN = 8  # int32 token id + float32 log-prob on the wire


@dataclass
class Setting:
    gpus: int
    max_lag: int  # 0 = synchronous colocated: every GPU generates, then every GPU trains
    gen_gpus: int
    train_gpus: int
    prompts_per_step: int
    steps: int
    warmup: int
    compression: float


@dataclass
class Result:
    setting: Setting
    samples_per_s: float  # simulated seconds
    tokens_per_s: float
    gen_idle: float  # share of generation-GPU time with nothing to decode (or paused for a sync)
    train_idle: float  # share of training-GPU time not training
    gpu_idle: float  # over all GPUs
    step_s: float  # simulated seconds per step
    mean_lag: float
    max_lag_seen: int
    dropped_stale: int
    buffer_cpu: float  # buffer process CPU seconds per wall second over the window
    lease_calls_s: float  # lease calls per wall second
    wall_s: float
    ranks: int
    extra: dict = field(default_factory=dict)


# ---- simulated engines -----------------------------------------------------------------------


class Fleet:
    """Every simulated engine, as asyncio tasks on one event loop in a thread of its own. The
    controller thread pauses and resumes them (a weight sync) through thread-safe calls."""

    def __init__(self, n: int, buffer, address: str, keys, run_id: str, lengths: Lengths, compression: float,
                 max_inflight: int, seed: int) -> None:
        self.n, self.buffer, self.address, self.keys, self.run_id = n, buffer, address, keys, run_id
        self.lengths, self.c, self.max_inflight = lengths, compression, max_inflight
        self.rng = np.random.default_rng(seed)
        pool = 1 << 20  # random token ids / log-probs; each sample takes a slice at a random offset
        self.tokens = self.rng.integers(0, 150_000, pool + lengths.cap, dtype=np.int32)
        self.logprobs = -self.rng.random(pool + lengths.cap, dtype=np.float32) * 4
        self.version = 0
        self.paused = False
        self.stopping = False  # checked by every loop: asyncio.wait_for can swallow a cancellation (3.11)
        self.busy_sim = [0.0] * n  # simulated seconds with a non-empty running set, not paused
        self.tokens_done = 0
        self.lease_calls = 0
        self.errors: list[str] = []
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._ready = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(60)

    async def _start(self) -> None:
        import zmq.asyncio

        self.ctx = zmq.asyncio.Context()
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.wakes = [asyncio.Event() for _ in range(self.n)]
        self.tasks = [asyncio.create_task(self._engine(i)) for i in range(self.n)]

    def pause(self) -> None:
        def do() -> None:
            self.paused = True
            self.resumed.clear()
            for w in self.wakes:
                w.set()
        self.loop.call_soon_threadsafe(do)

    def resume(self, version: int) -> None:
        def do() -> None:
            self.version = version
            self.paused = False
            self.resumed.set()
        self.loop.call_soon_threadsafe(do)

    def close(self) -> None:
        """Stop every engine. Does not raise: a run's own error must not be masked by teardown."""
        async def stop() -> None:
            self.stopping = True
            for w in self.wakes:
                w.set()
            self.resumed.set()
            for t in self.tasks:
                t.cancel()
            await asyncio.wait(self.tasks, timeout=20)
            self.ctx.destroy(linger=0)
        try:
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(60)
        except Exception as exc:  # noqa: BLE001 - reported, and the fleet's thread is a daemon
            print(f"fleet teardown: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    async def _engine(self, eid: int) -> None:
        import zmq

        from async_rl.security import harden_client

        push = self.ctx.socket(zmq.PUSH)
        harden_client(push, self.keys.engine)  # its own socket and CURVE session, as a real engine
        push.connect(self.address)
        wake = self.wakes[eid]
        queue: collections.deque = collections.deque()  # leased groups waiting for decode slots
        groups: dict[int, dict] = {}  # prompt_id -> lengths, finished count, versions
        running: list[list] = []  # [prompt_id, sample index, remaining tokens, context tokens]
        need = asyncio.Event()
        need.set()

        async def leaser() -> None:
            while not self.stopping:
                await self.resumed.wait()
                free = self.max_inflight - len(groups)
                if free < max(1, self.max_inflight // 4):  # lease in chunks: fewer Ray calls
                    need.clear()
                    await need.wait()
                    continue
                self.lease_calls += 1
                prompts = await self.buffer.lease.remote(eid, free, 0.5)
                for p in prompts:
                    groups[p.prompt_id] = {"lens": self.lengths.sample(self.rng, GROUP), "done": 0,
                                           "vf": [0] * GROUP, "vl": [0] * GROUP}
                    queue.append(p.prompt_id)
                if prompts:
                    wake.set()

        lease_task = asyncio.create_task(leaser())
        carry = 0.0
        try:
            while not self.stopping:
                if self.paused:
                    await self.resumed.wait()
                    wake.clear()
                    continue
                context = sum(s[3] for s in running)
                while queue and len(running) + GROUP <= MAX_NUM_SEQS and context < 0.9 * MODEL.kv_budget_tokens:
                    pid = queue.popleft()
                    g = groups[pid]
                    for i in range(GROUP):
                        g["vf"][i] = self.version
                        running.append([pid, i, int(g["lens"][i]), PROMPT_TOKENS])
                    context += GROUP * PROMPT_TOKENS
                if not running:
                    need.set()
                    await wake.wait()
                    wake.clear()
                    carry = 0.0
                    continue
                b = len(running)
                k = min(s[2] for s in running)
                dt = decode_step_s(b, context + b * k / 2)
                t0 = time.monotonic()
                try:
                    await asyncio.wait_for(wake.wait(), max(0.0, (k * dt - carry) / self.c))
                except TimeoutError:
                    pass
                wake.clear()
                elapsed = (time.monotonic() - t0) * self.c + carry
                steps = min(k, int(elapsed / dt))
                self.busy_sim[eid] += min(elapsed, k * dt) - carry  # the carry was counted already
                carry = elapsed - steps * dt if steps < k else 0.0
                if steps == 0:
                    continue
                self.tokens_done += steps * b
                still = []
                for s in running:
                    s[2] -= steps
                    s[3] += steps
                    if s[2] > 0:
                        still.append(s)
                        continue
                    g = groups[s[0]]
                    g["vl"][s[1]] = self.version
                    g["done"] += 1
                    if g["done"] == GROUP:
                        await push.send_multipart(self._frame(s[0], eid, groups.pop(s[0])))
                        need.set()
                running = still
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # a broken engine must show in the result, not hang the run
            self.errors.append(f"engine {eid}: {type(exc).__name__}: {exc}")
        finally:
            lease_task.cancel()
            push.close(linger=0)

    def _frame(self, pid: int, eid: int, g: dict) -> list[bytes]:
        offs = self.rng.integers(0, 1 << 20, GROUP + 1)
        comps = [self.tokens[o : o + n] for o, n in zip(offs[1:], g["lens"], strict=True)]
        lps = [self.logprobs[o : o + n] for o, n in zip(offs[1:], g["lens"], strict=True)]
        group = TrajectoryGroup(
            prompt_id=pid, engine_id=eid, prompt_tokens=self.tokens[offs[0] : offs[0] + PROMPT_TOKENS],
            completions=comps, logprobs=lps, rewards=[float(r) for r in self.rng.integers(0, 2, GROUP)],
            version_first=list(g["vf"]), version_last=list(g["vl"]), reward_status=[0] * GROUP,
        )
        return encode_groups(self.run_id, [group])


MODEL = Model()
GPU = Gpu()


# ---- the controller loop ---------------------------------------------------------------------


def ranks_for(prompts: int, train_gpus: int, cap: int = 32) -> int:
    """Learner ranks asking the buffer for shards: the largest divisor of the batch <= the GPUs."""
    return max(d for d in range(1, min(train_gpus, cap) + 1) if prompts % d == 0)


def run_setting(s: Setting, lengths: Lengths, seed: int) -> Result:
    import psutil
    import ray

    from async_rl.buffer.actor import BufferSettings, ReplayBuffer
    from async_rl.learner.batch_client import BatchClient
    from async_rl.security import make_run_keys

    run_id = uuid.uuid4().hex[:12]
    keys = make_run_keys()
    buffer = ray.remote(ReplayBuffer).options(num_cpus=0).remote(BufferSettings(
        run_id=run_id, host="127.0.0.1", ingest_port=0, serve_port=0, max_lag=s.max_lag,
        prompts_per_step=s.prompts_per_step, group_size=GROUP, filter_uniform_groups=False,
        max_frame_bytes=64 << 20, task_name="repeat", task_seed=seed, curve=keys.server))
    addresses = ray.get(buffer.start.remote())
    proc = psutil.Process(ray.get(buffer.__ray_call__.remote(lambda self: os.getpid())))
    me = psutil.Process()  # simulated engines, learner ranks and controller
    per_engine = math.ceil(s.prompts_per_step / s.gen_gpus)
    # Groups an engine holds (running or queued in vLLM): sync splits the batch evenly; async keeps
    # twice the running set, since a group whose other samples are done still holds a slot for its
    # longest one (what a user sets as generators.max_inflight_prompts).
    max_inflight = per_engine if s.max_lag == 0 else 2 * MAX_NUM_SEQS // GROUP
    fleet = Fleet(s.gen_gpus, buffer, addresses.ingest, keys, run_id, lengths, s.compression, max_inflight, seed)
    nranks = ranks_for(s.prompts_per_step, s.train_gpus)
    clients = [BatchClient(addresses.serve, run_id, r, nranks, keys.learner) for r in range(nranks)]
    pool = ThreadPoolExecutor(nranks)
    train_rate = train_tokens_per_s(GPU, MODEL) * s.train_gpus
    sync_cost = sync_s(GPU, MODEL)
    train_sim = 0.0
    samples = tokens = 0
    lags: list[float] = []
    maxlag = 0
    try:
        for step in range(s.warmup + s.steps):
            if step == s.warmup:  # the timed window starts
                t0, cpu0, me0 = time.monotonic(), sum(proc.cpu_times()[:2]), sum(me.cpu_times()[:2])
                tok0 = fleet.tokens_done
                busy0, train0, leases0 = sum(fleet.busy_sim), train_sim, fleet.lease_calls
                stats0 = ray.get(buffer.stats.remote())
            shards = list(pool.map(lambda c, st=step: c.fetch(st, 600.0), clients))
            batch = [g for shard in shards for g in shard]
            n_tok = sum(PROMPT_TOKENS + len(c) for g in batch for c in g.completions)
            t_train = n_tok / train_rate
            time.sleep(t_train / s.compression)
            train_sim += t_train
            fleet.pause()  # weight sync: engines pause, the buffer learns the version, engines resume
            time.sleep(sync_cost / s.compression)
            ray.get(buffer.set_generator_version.remote(step + 1))
            fleet.resume(step + 1)
            st = ray.get(buffer.stats.remote())
            if step >= s.warmup:
                samples += sum(g.size for g in batch)
                tokens += n_tok
                lags.append(st.last_batch_mean_lag)
                maxlag = max(maxlag, st.last_batch_max_lag)
        wall = time.monotonic() - t0
        cpu = sum(proc.cpu_times()[:2]) - cpu0
        me_cpu = sum(me.cpu_times()[:2]) - me0
        gen_tokens = fleet.tokens_done - tok0
        stats1 = ray.get(buffer.stats.remote())
    finally:
        fleet.close()
        for c in clients:
            c.close()
        pool.shutdown()
        ray.get(buffer.close.remote())
        ray.kill(buffer)
    if fleet.errors:
        raise RuntimeError("; ".join(fleet.errors[:3]))
    sim_wall = wall * s.compression
    gen_busy = sum(fleet.busy_sim) - busy0
    train_busy = (train_sim - train0) * s.train_gpus
    if s.max_lag == 0:  # colocated: the same GPUs take turns
        gpu_idle = 1 - (gen_busy + train_busy) / (s.gpus * sim_wall)
        gen_idle = 1 - gen_busy / (s.gen_gpus * sim_wall)
    else:
        gen_idle = 1 - gen_busy / (s.gen_gpus * sim_wall)
        gpu_idle = 1 - (gen_busy + train_busy) / (s.gpus * sim_wall)
    return Result(
        setting=s, samples_per_s=samples / sim_wall, tokens_per_s=tokens / sim_wall, gen_idle=gen_idle,
        train_idle=1 - train_busy / (s.train_gpus * sim_wall), gpu_idle=gpu_idle, step_s=sim_wall / s.steps,
        mean_lag=float(np.mean(lags)), max_lag_seen=maxlag,
        dropped_stale=stats1.accounts.dropped_stale - stats0.accounts.dropped_stale,
        buffer_cpu=cpu / wall, lease_calls_s=(fleet.lease_calls - leases0) / wall, wall_s=wall, ranks=nranks,
        extra={"driver_cpu": me_cpu / wall, "ingest_mb_s": gen_tokens * BYTES_PER_TOKEN / wall / 1e6,
               "decode_tokens_s_per_busy_gpu": gen_tokens / max(gen_busy, 1e-9)},
    )


# ---- settings ------------------------------------------------------------------------------------


def gen_rate_per_gpu(lengths: Lengths, batch: int = MAX_NUM_SEQS) -> float:
    """Decode tokens/s of one engine with `batch` running samples half-way through their lengths."""
    return decode_tokens_per_s(batch, PROMPT_TOKENS + lengths.mean() / 2, GPU, MODEL)


def compression_for(gen_gpus: int, batch: int, lengths: Lengths, max_mb_s: float, max_c: float) -> float:
    """Time compression: the most that keeps the buffer's ingest under `max_mb_s` with every engine
    decoding `batch` samples (sync: its share of the batch; async: half of max_num_seqs)."""
    sim_bytes_s = gen_gpus * gen_rate_per_gpu(lengths, batch) * BYTES_PER_TOKEN
    return max(1.0, min(max_c, max_mb_s * 1e6 / sim_bytes_s))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 and 16 GPUs, few steps (< 2 minutes)")
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    ap.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2, 4])
    ap.add_argument("--splits", type=int, default=3, help="generation/training splits tried per async setting")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts-per-gpu", type=int, default=8)
    ap.add_argument("--max-mb-s", type=float, default=40.0, help="cap on the wire bytes/s the buffer ingests")
    ap.add_argument("--max-compression", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3,
                    help="repetitions of every point (seeds seed..seed+reps-1); tables give min/median/max")
    args = ap.parse_args()
    if args.quick:
        args.gpus, args.splits, args.steps, args.warmup, args.reps = [8, 16], 1, 2, 1, 1
    import ray

    lengths = Lengths()
    rng = np.random.default_rng(args.seed)
    sample = lengths.sample(rng, 200_000)
    p50, p99 = np.percentile(sample, [50, 99])
    # The split balances training against decode at a half-full running set (the long tail keeps
    # an engine's batch below max_num_seqs much of the time); the search then tries its neighbours.
    g_rate, t_rate = gen_rate_per_gpu(lengths, MAX_NUM_SEQS // 2), train_tokens_per_s(GPU, MODEL)
    print(f"lengths: median {p50:.0f}, p99 {p99:.0f} (p99/median {p99 / p50:.1f}), max {lengths.cap}, "
          f"mean {sample.mean():.0f}; decode {gen_rate_per_gpu(lengths):.0f} tok/s/GPU at batch {MAX_NUM_SEQS}, "
          f"{decode_tokens_per_s(1, 1000):.0f} at batch 1; train {t_rate:.0f} tok/s/GPU; sync {sync_s():.2f}s",
          flush=True)
    ray.init(num_cpus=len(os.sched_getaffinity(0)), include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=False)
    results: list[Result] = []
    t_all = time.monotonic()
    try:
        for n in args.gpus:
            ppstep = args.prompts_per_gpu * n
            split: int | None = None
            # the split is searched at max_lag 2 (listed first among the async lags) in the first
            # repetition, then kept for the other lags and repetitions
            for rep_i, lag in ((r, k) for r in range(args.reps)
                               for k in sorted(args.lags, key=lambda k: (k != 0, k != 2, k))):
                seed = args.seed + rep_i  # another draw of lengths and timings per repetition
                if lag == 0:
                    candidates = [n]
                elif split is None:
                    balanced, _ = split_gpus(n, g_rate, t_rate)
                    candidates = nearby_splits(n, balanced, args.splits)
                else:
                    candidates = [split]
                tried = []
                for g in candidates:
                    train = n if lag == 0 else n - g
                    batch = args.prompts_per_gpu * GROUP if lag == 0 else MAX_NUM_SEQS // 2
                    c = compression_for(g, batch, lengths, args.max_mb_s, args.max_compression)
                    s = Setting(n, lag, g, train, ppstep, args.steps, args.warmup, c)
                    r = run_setting(s, lengths, seed)
                    r.extra["rep"] = rep_i
                    tried.append(r)
                    print(f"rep {rep_i} gpus {n:4d} lag {lag} split {g:3d}:{train:3d} C {c:5.1f}: {r.samples_per_s:7.2f} "
                          f"samples/s, step {r.step_s:6.1f}s, idle gen {r.gen_idle:.0%} train {r.train_idle:.0%} "
                          f"all {r.gpu_idle:.0%}, lag {r.mean_lag:.2f}/{r.max_lag_seen}, buffer CPU "
                          f"{r.buffer_cpu:.0%}, driver CPU {r.extra['driver_cpu']:.0%}, ingest "
                          f"{r.extra['ingest_mb_s']:.0f} MB/s, wall {r.wall_s:.0f}s", flush=True)
                best = max(tried, key=lambda r: r.samples_per_s)
                if lag != 0 and split is None:
                    split = best.setting.gen_gpus
                    best.extra["splits_tried"] = [[r.setting.gen_gpus, r.samples_per_s] for r in tried]
                results.append(best)
                write_results(results, lengths, p50, p99, g_rate, t_rate, args, t_all)
    finally:
        ray.shutdown()
    write_results(results, lengths, p50, p99, g_rate, t_rate, args, t_all)
    name = "sim-quick" if args.quick else "sim"
    print(f"{'gpus':>5} {'lag':>3} {'split':>8} {'samples/s min/med/max':>24} {'speedup min/med/max':>20}")
    for p in summarize_points(results):
        s, sp = p["samples_per_s"], p["speedup_vs_sync"]
        print(f"{p['gpus']:5d} {p['max_lag']:3d} {p['split']:>8} {s['min']:7.1f}/{s['median']:7.1f}/{s['max']:7.1f} "
              f"{sp['min']:6.2f}/{sp['median']:5.2f}/{sp['max']:5.2f}")
    plot(results, RESULTS / f"{name}.png")


def summarize_points(results: list[Result]) -> list[dict]:
    """Per (GPUs, max_lag): samples/s and the speedup over sync of the same repetition, min/median/max
    over the repetitions that have both."""
    sync = {(r.setting.gpus, r.extra["rep"]): r.samples_per_s for r in results if r.setting.max_lag == 0}
    points: dict[tuple[int, int], list[Result]] = {}
    for r in results:
        points.setdefault((r.setting.gpus, r.setting.max_lag), []).append(r)
    out = []
    for (gpus, lag), rs in points.items():
        speedups = [r.samples_per_s / sync[gpus, r.extra["rep"]] for r in rs if (gpus, r.extra["rep"]) in sync]
        out.append({"gpus": gpus, "max_lag": lag, "split": f"{rs[0].setting.gen_gpus}:{rs[0].setting.train_gpus}",
                    "reps": len(rs), "samples_per_s": spread([r.samples_per_s for r in rs]),
                    "speedup_vs_sync": spread(speedups) if speedups else None})
    return out


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": float(np.median(values)), "max": max(values)}


def write_results(results: list[Result], lengths: Lengths, p50: float, p99: float, g_rate: float, t_rate: float,
                  args: argparse.Namespace, t_all: float) -> list[dict]:
    """results/sim.json (sim-quick.json with --quick), rewritten after every setting."""
    import psutil

    sync = {(r.setting.gpus, r.extra["rep"]): r.samples_per_s for r in results if r.setting.max_lag == 0}
    rows = []
    for r in results:
        row = asdict(r)
        key = (r.setting.gpus, r.extra["rep"])
        row["speedup_vs_sync"] = r.samples_per_s / sync[key] if key in sync else None
        rows.append(row)
    out = {
        "machine": {"cpus": len(os.sched_getaffinity(0)), "mem_gb": psutil.virtual_memory().total / 1e9,
                    "loadavg_at_end": os.getloadavg()},
        "calibration": {"gpu": asdict(GPU), "model": asdict(MODEL), "lengths": asdict(lengths),
                        "length_p50": float(p50), "length_p99": float(p99), "gen_tokens_s_per_gpu": g_rate,
                        "train_tokens_s_per_gpu": t_rate, "sync_s": sync_s(), "max_num_seqs": MAX_NUM_SEQS,
                        "group": GROUP, "prompt_tokens": PROMPT_TOKENS, "prompts_per_gpu": args.prompts_per_gpu},
        "args": vars(args), "wall_s": time.monotonic() - t_all, "points": summarize_points(results),
        "results": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / ("sim-quick.json" if args.quick else "sim.json")).write_text(json.dumps(out, indent=1))
    return rows


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    points = summarize_points(results)
    for lag in sorted({p["max_lag"] for p in points}):
        ps = sorted((p for p in points if p["max_lag"] == lag and p["speedup_vs_sync"]), key=lambda p: p["gpus"])
        label = "sync (colocated)" if lag == 0 else f"max_lag {lag}"
        gpus = [p["gpus"] for p in ps]
        for ax, key in ((a, "samples_per_s"), (b, "speedup_vs_sync")):
            med = [p[key]["median"] for p in ps]
            err = [[m - p[key]["min"] for m, p in zip(med, ps, strict=True)],
                   [p[key]["max"] - m for m, p in zip(med, ps, strict=True)]]
            ax.errorbar(gpus, med, yerr=err, fmt="o-", capsize=3, label=label)
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("simulated H100 GPUs")
        ax.grid(alpha=0.3)
    a.set_yscale("log")
    a.set_ylabel("samples/s (simulated time)")
    b.set_ylabel("speedup over sync")
    b.axhline(2.35, ls="--", c="gray", lw=0.8)
    b.text(8, 2.4, "verl fully-async, 128 GPUs: 2.35x", fontsize=7, color="gray")
    b.axhline(2.77, ls=":", c="gray", lw=0.8)
    b.text(8, 2.82, "AReaL: up to 2.77x", fontsize=7, color="gray")
    a.legend(fontsize=8)
    fig.suptitle("bench_sim: real buffer + control loop, simulated 7B engines/learners (H100 calibration)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
