"""Trajectory transport: our ZMQ + msgspec frames against Ray actor calls and pickle over ZMQ, and the
real replay buffer's ingest path.

Transports (every one moves the same `TrajectoryGroup` objects, encoded at send time by the producer
and decoded by the consumer; the producers and the consumer share this machine's cores):

  zmq+msgspec   our wire format (`protocol.encode_groups` / `decode_groups`, which validates every
                frame) over a ZMQ PUSH -> PULL socket
  zmq+pickle    pickle.dumps / pickle.loads (protocol 5) over the same socket: no validation
  ray           one Ray actor call per trajectory to a consumer actor (numpy arrays over 100 KB go
                through Ray's object store); at most 8 calls in flight per producer; its throughput
                pass moves a tenth as many trajectories (it is a rate; this keeps the pass short)
  buffer        our frames into the real `ReplayBuffer` ingest loop (decode, validation, prompt lease
                checks, ledger), prompts leased beforehand; no per-frame timestamp (the frame is
                exactly what an engine sends), so no latency column

A trajectory is one completion of N tokens (int32 ids + float32 log-probs) with a 16-token prompt,
sent one per frame (group size 1: the strictest case for per-frame overhead).

Throughput pass: every producer sends its share as fast as the transport takes it; trajectories/s
= total / (time of the last receipt - the start signal). Latency pass: the producers together send
at a fixed low rate (no queueing), and latency is the consumer's decode-complete time minus the
producer's send time (CLOCK_MONOTONIC, shared by processes on one host).

    python benchmarks/bench_transport.py [--quick] [--repeats 3]

`--images`: no transports; the frame of one vision-language group (8 samples, 256-token prompt and
completions) with 0, 1 or 4 images of 56x56, 448x448 and 1024x1024 pixels (a smooth gradient with
noise, PNG and JPEG at quality 90), as we send it (the encoded files once in the header) against the
same group with Qwen2.5-VL's processed pixel values instead, and encode + decode groups/s and MB/s in
one process (`protocol.encode_groups` then `decode_groups`, what an engine and the buffer's ingest do).

    python benchmarks/bench_transport.py --images [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import pickle
import statistics
import struct
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO))

from async_rl.protocol import TrajectoryGroup, decode_groups, encode_groups  # noqa: E402

RUN_ID = "bench"
PROMPT_TOKENS = 16
Routes = tuple[int, int] | None  # (MoE layers, top_k) of routes to attach
TS = struct.Struct("<q")


def make_group(prompt_id: int, engine_id: int, n_tokens: int, seed: int, routes: Routes = None) -> TrajectoryGroup:
    """`routes`: (MoE layers, top_k) of routes to attach (uint8 for 128 experts), or None."""
    rng = np.random.default_rng(seed)
    g = TrajectoryGroup(
        prompt_id=prompt_id,
        engine_id=engine_id,
        prompt_tokens=rng.integers(0, 50_000, PROMPT_TOKENS, dtype=np.int32),
        completions=[rng.integers(0, 50_000, n_tokens, dtype=np.int32)],
        logprobs=[-rng.random(n_tokens, dtype=np.float32)],
        rewards=[1.0],
        version_first=[0],
        version_last=[0],
        reward_status=[0],
    )
    if routes is not None:
        layers, top_k = routes
        rows = PROMPT_TOKENS + n_tokens - 1
        g.routes = [np.argsort(rng.random((rows, layers, 128), dtype=np.float32), -1)[..., :top_k].astype(np.uint8)]
    return g


def traj_bytes(n_tokens: int, routes: Routes = None) -> int:
    route_bytes = (PROMPT_TOKENS + n_tokens - 1) * routes[0] * routes[1] if routes is not None else 0
    return (PROMPT_TOKENS + n_tokens) * 4 + n_tokens * 4 + route_bytes


def count_for(n_tokens: int, quick: bool) -> int:
    """Trajectories per throughput pass: about the same number of bytes for every size."""
    n = {256: 40_000, 2048: 8_000, 16384: 1_200}.get(n_tokens, max(200, 10_000_000 // traj_bytes(n_tokens)))
    return max(100, n // 10) if quick else n


# ---- ZMQ producers and consumers -----------------------------------------------------------------


def zmq_producer(address: str, codec: str, n_tokens: int, prompt_ids: list[int], engine_id: int,
                 rate: float, timestamps: bool, routes: Routes, ready, go) -> None:
    import zmq

    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, -1)
    push.connect(address)
    groups = [make_group(pid, engine_id, n_tokens, pid, routes) for pid in prompt_ids]
    ready.wait()
    go.wait()
    t_next = time.monotonic()
    for g in groups:
        if rate:
            t_next += 1.0 / rate
            delay = t_next - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        ts = [TS.pack(time.monotonic_ns())] if timestamps else []
        if codec == "msgspec":
            push.send_multipart([*encode_groups(RUN_ID, [g]), *ts], copy=False)
        else:
            push.send_multipart([pickle.dumps(g, protocol=5), *ts], copy=False)
    push.close()
    ctx.term()


# Producers come from a fork server started before Ray (forking a process that runs Ray's threads is
# unsafe); it preloads this module, so a new producer costs a fork, not an interpreter start.
_MP = mp.get_context("forkserver")


def start_fork_server() -> None:
    _MP.set_forkserver_preload(["__main__", "numpy", "zmq", "async_rl.protocol"])
    p = _MP.Process(target=time.sleep, args=(0,))
    p.start()
    p.join()


def start_producers(target, args_for, n_producers: int):
    ctx = _MP
    ready, go = ctx.Barrier(n_producers + 1), ctx.Event()
    procs = [ctx.Process(target=target, args=(*args_for(i), ready, go), daemon=True) for i in range(n_producers)]
    for p in procs:
        p.start()
    return procs, ready, go


def split(ids: list[int], n: int) -> list[list[int]]:
    return [ids[i::n] for i in range(n)]


def run_zmq(codec: str, n_tokens: int, producers: int, total: int, rate: float, routes: Routes = None) -> dict:
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    shares = split(list(range(total)), producers)
    procs, ready, go = start_producers(
        zmq_producer,
        lambda i: (f"tcp://127.0.0.1:{port}", codec, n_tokens, shares[i], i, rate / producers, True, routes),
        producers,
    )
    ready.wait()
    t0 = time.monotonic()
    go.set()
    lat = []
    received = 0
    while received < total:
        frames = pull.recv_multipart(copy=False)
        body = [f.buffer for f in frames[:-1]]
        if codec == "msgspec":
            _, groups = decode_groups(body, RUN_ID)
        else:
            groups = [pickle.loads(body[0])]
        received += len(groups)
        lat.append(time.monotonic_ns() - TS.unpack(frames[-1].buffer)[0])
    t1 = time.monotonic()
    for p in procs:
        p.join()
    ctx.destroy(linger=0)
    return {"seconds": t1 - t0, "latency_ns": lat}


# ---- the real buffer -----------------------------------------------------------------------------


def run_buffer(n_tokens: int, producers: int, total: int, routes: Routes = None) -> dict:
    """Frames from `producers` processes into ReplayBuffer's ingest loop, in this process."""
    from async_rl.buffer.actor import BufferSettings, ReplayBuffer

    settings = BufferSettings(
        run_id=RUN_ID, host="127.0.0.1", ingest_port=0, serve_port=0, max_lag=0,
        prompts_per_step=total, group_size=1, filter_uniform_groups=False, max_frame_bytes=64 << 20,
        task_name="repeat", task_seed=0,
    )

    async def main() -> dict:
        buf = ReplayBuffer(settings)
        addresses = await buf.start()
        shares = []
        for i in range(producers):  # each producer is an engine with its own leased prompts
            want = len(range(i, total, producers))
            leased = await buf.lease(i, want, wait_s=0)
            shares.append([p.prompt_id for p in leased])
        procs, ready, go = start_producers(
            zmq_producer, lambda i: (addresses.ingest, "msgspec", n_tokens, shares[i], i, 0.0, False, routes), producers
        )
        await asyncio.get_running_loop().run_in_executor(None, ready.wait)
        cpu0 = time.process_time()
        t0 = time.monotonic()
        go.set()
        while buf.server.waiting_groups + sum(buf.stats().rejected_frames.values()) < total:
            await asyncio.sleep(0.002)  # polling, not a condition: no extra wake-up per frame
        t1 = time.monotonic()
        cpu = time.process_time() - cpu0
        stats = buf.stats()
        await buf.close()
        for p in procs:
            p.join()
        if stats.rejected_frames or stats.accounts.waiting != total:
            raise RuntimeError(f"buffer rejected frames: {stats.rejected_frames}")
        return {"seconds": t1 - t0, "latency_ns": [], "buffer_cpu_s": cpu}

    return asyncio.run(main())


# ---- Ray -----------------------------------------------------------------------------------------


class RayConsumer:
    def __init__(self) -> None:
        self.count = 0
        self.lat: list[int] = []
        self.last = 0.0
        self.done = asyncio.Event()
        self.total = 0

    def expect(self, total: int) -> None:
        self.count, self.lat, self.total = 0, [], total
        self.done = asyncio.Event()

    async def put(self, group: TrajectoryGroup, t_send_ns: int) -> None:
        self.count += 1
        self.lat.append(time.monotonic_ns() - t_send_ns)
        if self.count >= self.total:
            self.last = time.monotonic()
            self.done.set()

    async def finished(self) -> tuple[float, list[int]]:
        await self.done.wait()
        return self.last, self.lat


class RayProducer:
    def __init__(self, consumer) -> None:
        self.consumer = consumer

    def prepare(self, n_tokens: int, prompt_ids: list[int], engine_id: int) -> None:
        self.groups = [make_group(pid, engine_id, n_tokens, pid) for pid in prompt_ids]

    def run(self, rate: float) -> None:
        import ray

        inflight = []
        t_next = time.monotonic()
        for g in self.groups:
            if rate:
                t_next += 1.0 / rate
                delay = t_next - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            inflight.append(self.consumer.put.remote(g, time.monotonic_ns()))
            if len(inflight) >= 8:
                _, inflight = ray.wait(inflight, num_returns=1)
        ray.get(inflight)


def run_ray(n_tokens: int, producers: int, total: int, rate: float) -> dict:
    import ray

    consumer = ray.remote(RayConsumer).options(num_cpus=0).remote()
    prods = [ray.remote(RayProducer).options(num_cpus=0).remote(consumer) for _ in range(producers)]
    shares = split(list(range(total)), producers)
    ray.get([p.prepare.remote(n_tokens, shares[i], i) for i, p in enumerate(prods)])
    ray.get(consumer.expect.remote(total))
    t0 = time.monotonic()
    runs = [p.run.remote(rate / producers) for p in prods]
    last, lat = ray.get(consumer.finished.remote())
    ray.get(runs)
    for a in [*prods, consumer]:
        ray.kill(a)
    return {"seconds": last - t0, "latency_ns": lat}


# ---- images in the frame -------------------------------------------------------------------------

IMAGE_SIZES = (56, 448, 1024)
IMAGE_COUNTS = (0, 1, 4)
IMAGE_CODECS = ("png", "jpeg90")
IMAGE_GROUP = 8  # samples of the group
IMAGE_TEXT_TOKENS = 256  # the prompt's text tokens (its image placeholders come on top) and each completion's
QWEN_PATCH = 14  # pixels a side of a ViT patch
QWEN_MERGE = 2  # the merger joins 2x2 patches into one token: sizes are multiples of 28
QWEN_MIN_PIXELS = 56 * 56  # Qwen2.5-VL's processor default floor
# One patch as the processor hands it to the model: 3 channels x 2 frames (an image is repeated to
# the temporal patch of 2) x 14 x 14, float32
QWEN_PATCH_BYTES = 3 * 2 * QWEN_PATCH * QWEN_PATCH * 4


def qwen_vl_resized(width: int, height: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(width, height) Qwen2.5-VL's processor resizes an image to: each side a multiple of 28, the
    aspect kept, the area within [min_pixels, max_pixels] (scaled down by flooring, up by ceiling; a
    side that rounds to 0 is scaled up with the rest, as transformers' smart_resize does)."""
    f = QWEN_PATCH * QWEN_MERGE
    w, h = round(width / f) * f, round(height / f) * f
    if w * h > max_pixels:
        scale = math.sqrt(width * height / max_pixels)
        w, h = max(f, math.floor(width / scale / f) * f), max(f, math.floor(height / scale / f) * f)
    elif w * h < min_pixels:
        scale = math.sqrt(min_pixels / (width * height))
        w, h = math.ceil(width * scale / f) * f, math.ceil(height * scale / f) * f
    return w, h


def qwen_vl_patches(width: int, height: int, min_pixels: int, max_pixels: int) -> int:
    """Patches of one image after the resize: pixel_values rows (each QWEN_PATCH_BYTES); tokens are a quarter."""
    w, h = qwen_vl_resized(width, height, min_pixels, max_pixels)
    return (w // QWEN_PATCH) * (h // QWEN_PATCH)


def natural_image(size: int, seed: int) -> np.ndarray:
    """An RGB uint8 image that compresses like a photograph more than a flat colour does: smooth
    gradients and low-frequency waves per channel, plus per-pixel noise (sigma 6)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    channels = []
    for _ in range(3):
        a, b, fx, fy, phase = rng.uniform(0.2, 1.0, 5)
        wave = np.sin(2 * np.pi * (fx * 3 * x + fy * 2 * y) + phase * 6)
        channels.append(255 * (0.35 * a * x + 0.35 * b * y + 0.15 * wave + 0.2))
    pixels = np.stack(channels, -1) + rng.normal(0, 6, (size, size, 3))
    return np.clip(pixels, 0, 255).astype(np.uint8)


def encode_image(pixels: np.ndarray, codec: str) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    if codec == "png":
        Image.fromarray(pixels).save(out, format="PNG")
    else:  # jpeg90
        Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def image_group(images: list[bytes], image_tokens: int, seed: int = 0) -> TrajectoryGroup:
    """A group of IMAGE_GROUP samples whose prompt holds IMAGE_TEXT_TOKENS text tokens and the images'
    `image_tokens` placeholders (a VLM prompt's ids carry them expanded), its images in the header."""
    rng = np.random.default_rng(seed)
    n = IMAGE_TEXT_TOKENS
    return TrajectoryGroup(
        prompt_id=0,
        engine_id=0,
        prompt_tokens=rng.integers(0, 150_000, n + image_tokens, dtype=np.int32),
        completions=[rng.integers(0, 150_000, n, dtype=np.int32) for _ in range(IMAGE_GROUP)],
        logprobs=[-rng.random(n, dtype=np.float32) for _ in range(IMAGE_GROUP)],
        rewards=[1.0] * IMAGE_GROUP,
        version_first=[0] * IMAGE_GROUP,
        version_last=[0] * IMAGE_GROUP,
        reward_status=[0] * IMAGE_GROUP,
        images=list(images) or None,
    )


def frame_bytes(group: TrajectoryGroup) -> int:
    return sum(len(part) for part in encode_groups(RUN_ID, [group]))


def round_trips(group: TrajectoryGroup, seconds: float) -> tuple[float, float]:
    """encode_groups + decode_groups (with its validation) of one group, as often as `seconds` allow:
    (round trips per wall-clock second, CPU microseconds of this process per round trip). The CPU
    time is the cost on a machine other work shares; the wall-clock rate is what it sustained there."""
    n, t0, cpu0 = 0, time.perf_counter(), time.process_time()
    while True:
        decode_groups(encode_groups(RUN_ID, [group]), RUN_ID)
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds and n >= 3:
            return n / elapsed, (time.process_time() - cpu0) / n * 1e6


def decode_ms(images: list[bytes]) -> float:
    """Milliseconds to decode a group's images to RGB pixels (what the learner does once per group)."""
    from async_rl.images import decode

    if not images:
        return 0.0
    t0 = time.perf_counter()
    for data in images:
        decode(data)
    return (time.perf_counter() - t0) * 1e3


def processor_patches(pixels: np.ndarray, min_pixels: int, max_pixels: int) -> tuple[int, int] | None:
    """(patches, pixel_values bytes) from the Qwen2-VL image processor the tiny VLM preset saves
    (models/tiny_vl.py), to check the arithmetic; None where transformers lacks it."""
    try:
        from PIL import Image
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    except ImportError:
        return None
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    proc = Qwen2VLImageProcessorPil(size=size, min_pixels=min_pixels, max_pixels=max_pixels)
    values = np.asarray(proc(images=[Image.fromarray(pixels)], return_tensors="np")["pixel_values"])
    return values.shape[0], values.nbytes


def measure_images(quick: bool, repeats: int) -> list[dict]:
    """One row per (images, size, codec): the frame as sent, the frame with processed pixels instead,
    and encode + decode throughput. The `repeats` timed passes go over all rows in turn (a burst of other
    work on the shared machine then lands on several rows' passes, not all of one row's)."""
    seconds = 0.25 if quick else 1.0
    base = image_group([], 0)
    cases = [(0, 0, "")] + [(k, s, c) for k in IMAGE_COUNTS if k for s in IMAGE_SIZES for c in IMAGE_CODECS]
    pixels = {s: [natural_image(s, seed) for seed in range(max(IMAGE_COUNTS))] for s in IMAGE_SIZES}
    checked = {}
    for s in IMAGE_SIZES:  # at max_pixels = H x W: the image's own size, rounded to multiples of 28
        want = qwen_vl_patches(s, s, QWEN_MIN_PIXELS, s * s)
        got = processor_patches(pixels[s][0], QWEN_MIN_PIXELS, s * s)
        if got is not None and got != (want, want * QWEN_PATCH_BYTES):
            raise SystemExit(f"{s}x{s}: the processor gives {got} (patches, bytes), the arithmetic {want}")
        checked[s] = got is not None
    rows, groups = [], []
    for count, size, codec in cases:
        images = [encode_image(p, codec) for p in pixels[size][:count]] if count else []
        patches = count * qwen_vl_patches(size, size, QWEN_MIN_PIXELS, size * size) if count else 0
        group = image_group(images, patches // (QWEN_MERGE * QWEN_MERGE))
        sent = frame_bytes(group)
        _, back = decode_groups(encode_groups(RUN_ID, [group]), RUN_ID)
        assert (back[0].images or []) == images  # the bytes arrive as they left
        # The alternative: the same group (tokens, log-probs) with the pixel values in place of the files
        processed = sent - sum(len(b) for b in images) + patches * QWEN_PATCH_BYTES
        groups.append(group)
        rows.append({
            "images": count, "size": size, "codec": codec,
            "image_bytes": len(images[0]) if images else 0,
            "frame_bytes": sent, "text_frame_bytes": frame_bytes(base),
            "patches": patches, "pixel_bytes": patches * QWEN_PATCH_BYTES, "processed_frame_bytes": processed,
            "processed_over_sent": processed / sent, "processor_checked": checked.get(size, False),
            "groups_per_s_reps": [], "cpu_us_reps": [], "decode_ms_reps": [],
        })
    round_trips(base, 0.3)  # warm-up: the first timed row would pay msgspec's and numpy's first calls
    for _ in range(repeats):
        for row, group in zip(rows, groups, strict=True):
            rate, cpu_us = round_trips(group, seconds)
            row["groups_per_s_reps"].append(rate)
            row["cpu_us_reps"].append(cpu_us)
            row["decode_ms_reps"].append(decode_ms(group.images or []))
    for row in rows:
        row["groups_per_s"] = statistics.median(row["groups_per_s_reps"])
        row["mb_per_s"] = row["groups_per_s"] * row["frame_bytes"] / 1e6
        row["cpu_us_per_group"] = statistics.median(row["cpu_us_reps"])
        row["image_decode_ms"] = statistics.median(row["decode_ms_reps"])
    return rows


def image_table(rows: list[dict]) -> list[str]:
    lines = [
        "| images | size | codec | one image KB | frame KB (sent) | pixel values MB | processed / sent | "
        "encode + decode groups/s min / **med** / max | MB/s | CPU us a group | image decode ms |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        size = f"{r['size']}x{r['size']}" if r["images"] else "-"
        reps = r["groups_per_s_reps"]
        lines.append(
            f"| {r['images']} | {size} | {r['codec'] or '-'} | {r['image_bytes'] / 1e3:.1f} | {r['frame_bytes'] / 1e3:.1f} | "
            f"{r['pixel_bytes'] / 1e6:.2f} | {r['processed_over_sent']:.1f}x | "
            f"{min(reps):,.0f} / **{r['groups_per_s']:,.0f}** / {max(reps):,.0f} | {r['mb_per_s']:,.0f} | "
            f"{r['cpu_us_per_group']:,.0f} | {r['image_decode_ms']:.1f} |"
        )
    return lines


def plot_images(rows: list[dict], path: Path) -> None:
    """Bytes per group on the wire: as sent (encoded files) against processed pixel values, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['images']}x{r['size']} {r['codec']}" if r["images"] else "text only" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(x - 0.2, [r["frame_bytes"] / 1e6 for r in rows], 0.4, label="sent (encoded images in the header)")
    ax.bar(x + 0.2, [r["processed_frame_bytes"] / 1e6 for r in rows], 0.4, label="with processed pixel values")
    ax.set_xticks(x, labels, rotation=45, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("MB per group of 8")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_images(args: argparse.Namespace) -> None:
    out = args.out or ("transport-images-quick" if args.quick else "transport-images")
    repeats = 1 if args.quick else args.repeats
    command = "python benchmarks/bench_transport.py " + " ".join(sys.argv[1:])
    load_before = os.getloadavg()[0]
    rows = measure_images(args.quick, repeats)
    table = image_table(rows)
    print("\n".join(table))
    meta = {"command": command, "repeats": repeats, "cores": len(os.sched_getaffinity(0)),
            "load_average_1min": [load_before, os.getloadavg()[0]], "group": IMAGE_GROUP, "text_tokens": IMAGE_TEXT_TOKENS,
            "min_pixels": QWEN_MIN_PIXELS, "max_pixels": "H x W of each image", "patch_bytes": QWEN_PATCH_BYTES}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{out}.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    (RESULTS / f"{out}.md").write_text(
        f"Frame sizes with images (`{command}`; {meta['cores']} cores, 1-minute load average "
        f"{load_before:.1f} before and {os.getloadavg()[0]:.1f} after, {repeats} timed pass(es) per row)\n\n"
        + "\n".join(table) + "\n"
    )
    plot_images(rows, RESULTS / f"{out}.png")
    print(f"wrote {RESULTS / (out + '.json')}, .md and .png")


# ---- driver --------------------------------------------------------------------------------------


def percentile(values: list[int], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) / 1e6 if values else float("nan")


def measure(
    transport: str, n_tokens: int, producers: int, total: int, latency_rate: float, latency_n: int, routes: Routes = None
) -> dict:
    if transport == "buffer":
        thr = run_buffer(n_tokens, producers, total, routes)
        lat = thr
    elif transport == "ray":
        # A rate, not a total: a tenth of the trajectories keeps Ray's pass under a minute.
        total = max(200, total // 10)
        thr = run_ray(n_tokens, producers, total, 0.0)
        lat = run_ray(n_tokens, producers, latency_n, latency_rate)
    else:
        codec = transport.split("+")[1]
        thr = run_zmq(codec, n_tokens, producers, total, 0.0, routes)
        lat = run_zmq(codec, n_tokens, producers, latency_n, latency_rate, routes)
    tps = total / thr["seconds"]
    row = {
        "trajectories": total,
        "traj_per_s": tps,
        "mb_per_s": tps * traj_bytes(n_tokens, routes) / 1e6,
        "p50_ms": percentile(lat["latency_ns"], 50),
        "p99_ms": percentile(lat["latency_ns"], 99),
    }
    if "buffer_cpu_s" in thr:
        row["buffer_cpu_us_per_traj"] = thr["buffer_cpu_s"] / total * 1e6
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["tokens"] for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.2 * len(sizes), 3.8), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        for transport in dict.fromkeys(r["transport"] for r in rows):
            pts = sorted((r["producers"], r["traj_per_s"]["median"]) for r in rows
                         if r["tokens"] == size and r["transport"] == transport)
            ax.plot([p for p, _ in pts], [v for _, v in pts], marker="o", label=transport)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("producer processes")
        ax.set_title(f"{size} tokens per trajectory")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("trajectories/s (median)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10x fewer trajectories, 1 repetition")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", default="256,2048,16384")
    ap.add_argument("--producers", default="1,4,16")
    ap.add_argument("--transports", default="zmq+msgspec,zmq+pickle,ray,buffer")
    ap.add_argument("--latency-rate", type=float, default=200.0, help="trajectories/s of the latency pass")
    ap.add_argument("--routes", default="", help="LAYERS,TOP_K: attach MoE routes (uint8) to every trajectory")
    ap.add_argument("--images", action="store_true", help="frame sizes and encode + decode rates of a group with images")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.images:
        run_images(args)
        return
    out = args.out or ("transport-quick" if args.quick else "transport")
    repeats = 1 if args.quick else args.repeats
    transports = args.transports.split(",")
    latency_n = 100 if args.quick else 400
    routes = tuple(int(x) for x in args.routes.split(",")) if args.routes else None
    if routes is not None and "ray" in transports:
        raise SystemExit("--routes: the zmq and buffer transports only")
    start_fork_server()
    if "ray" in transports:
        import logging

        import ray

        ray.init(num_cpus=len(os.sched_getaffinity(0)), include_dashboard=False, logging_level=logging.WARNING,
                 log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    rows = []
    print(f"{'transport':<12} {'tokens':>6} {'prod':>4} {'traj/s min/med/max':>27} {'MB/s':>8} {'p50 ms':>7} "
          f"{'p99 ms':>7}", flush=True)
    try:
        for n_tokens in [int(x) for x in args.tokens.split(",")]:
            total = count_for(n_tokens, args.quick)
            for producers in [int(x) for x in args.producers.split(",")]:
                for transport in transports:
                    reps = [measure(transport, n_tokens, producers, total, args.latency_rate, latency_n, routes)
                            for _ in range(repeats)]
                    tps = [r["traj_per_s"] for r in reps]
                    row = {
                        "transport": transport, "tokens": n_tokens, "producers": producers, "trajectories": total,
                        "traj_per_s": {"min": min(tps), "median": statistics.median(tps), "max": max(tps)},
                        "mb_per_s": statistics.median(r["mb_per_s"] for r in reps),
                        "p50_ms": statistics.median(r["p50_ms"] for r in reps),
                        "p99_ms": statistics.median(r["p99_ms"] for r in reps),
                        "reps": reps,
                    }
                    if "buffer_cpu_us_per_traj" in reps[0]:
                        row["buffer_cpu_us_per_traj"] = statistics.median(r["buffer_cpu_us_per_traj"] for r in reps)
                    rows.append(row)
                    t = row["traj_per_s"]
                    extra = f"  buffer CPU {row['buffer_cpu_us_per_traj']:.0f} us/traj" if "buffer_cpu_us_per_traj" in row else ""
                    print(f"{transport:<12} {n_tokens:>6} {producers:>4} {t['min']:8.0f}/{t['median']:8.0f}/{t['max']:8.0f} "
                          f"{row['mb_per_s']:8.1f} {row['p50_ms']:7.2f} {row['p99_ms']:7.2f}{extra}", flush=True)
    finally:
        if "ray" in transports:
            import ray

            ray.shutdown()
    ratios = {}
    for n_tokens in sorted({r["tokens"] for r in rows}):
        for producers in sorted({r["producers"] for r in rows}):
            by = {r["transport"]: r["traj_per_s"]["median"] for r in rows
                  if r["tokens"] == n_tokens and r["producers"] == producers}
            if "zmq+msgspec" in by and "ray" in by:
                ratios[f"{n_tokens}x{producers}"] = by["zmq+msgspec"] / by["ray"]
    print("\nours / Ray (median traj/s): " + ", ".join(f"{k}: {v:.1f}x" for k, v in ratios.items()))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{out}.json").write_text(json.dumps(
        {"repeats": repeats, "latency_rate": args.latency_rate, "routes": routes, "cores": len(os.sched_getaffinity(0)),
         "ours_over_ray": ratios, "rows": rows}, indent=2))
    plot(rows, RESULTS / f"{out}.png")
    print(f"wrote {RESULTS / (out + '.json')} and .png")


if __name__ == "__main__":
    main()
