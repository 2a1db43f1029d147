"""Weight-sync throughput: our bucketed broadcast against the Ray object store and memcpy.

State dicts shaped like a transformer's (embedding, per-layer attention and MLP matrices, norms;
over 300 tensors) of several sizes go from one sender process to 1 and 2 receiver processes, each
of which copies what it receives into its own preallocated parameters (as vLLM's load_weights
does). Measured per method, size and receiver count, min/median/max over repetitions:

  ours-gloo async_rl.weight_sync over a gloo group (buckets, double buffering, 'sampled' chunk
            checksum), timed from the update header to a barrier after every receiver has copied
            everything
  ours-shm  the same protocol, bucket bytes through one /dev/shm mapping (same host only); the
            sender's tensors live in the mapping (as the learner's parameters do), so only the
            receivers copy. Rows -ckfull/-ckoff: other checksum modes; -packed: sender packs
  ray       one ray.put of the state dict, then every receiver ray.get()s it and copies it in
  memcpy    one torch copy_ of the same number of bytes in this process: the physical limit

    .venv/bin/python benchmarks/bench_weight_sync.py [--sizes-mb 50 500 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
LAYERS = 36  # 9 tensors per layer + embedding + final norm = 326 tensors


def transformer_shapes(total_mb: float) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a Llama-like model whose float32 parameters add up to ~total_mb."""
    # Per layer: q,k,v,o (h*h each) + gate,up,down (h*3h each) + 2 norms; embedding 8h*h.
    # Solve (LAYERS*13 + 8) * h^2 * 4 bytes = total.
    h = int(math.sqrt(total_mb * 2**20 / 4 / (LAYERS * 13 + 8)))
    h = max(8, h - h % 8)
    shapes = [("model.embed_tokens.weight", (8 * h, h))]
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        shapes += [(f"{p}.self_attn.{n}_proj.weight", (h, h)) for n in "qkvo"]
        shapes += [(f"{p}.mlp.{n}_proj.weight", (3 * h, h)) for n in ("gate", "up")]
        shapes += [(f"{p}.mlp.down_proj.weight", (h, 3 * h))]
        shapes += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,))]
    shapes.append(("model.norm.weight", (h,)))
    return shapes


def make_state(shapes, fill: float | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        n: (torch.full(s, fill) if fill is not None else torch.randn(s, generator=g)) for n, s in shapes
    }


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# ---- ours ---------------------------------------------------------------------------------------


def _receiver(info_bytes: bytes, rank: int, shapes, manifest_bytes: bytes, repeats: int):
    import msgspec

    from async_rl.weight_sync.base import WeightGroupInfo
    from async_rl.weight_sync.bucketing import Manifest
    from async_rl.weight_sync.transport import join_receiver

    torch.set_num_threads(1)
    params = make_state(shapes, fill=0.0)
    manifest = msgspec.msgpack.decode(manifest_bytes, type=Manifest)
    receiver = join_receiver(msgspec.msgpack.decode(info_bytes, type=WeightGroupInfo), rank, manifest)

    def load(named):
        for name, t in named:
            params[name].copy_(t)

    for v in range(repeats):
        receiver.group.barrier()  # matches the sender's "everyone ready" barrier
        receiver.receive(v, load)
        receiver.group.barrier()


def bench_ours(
    state, receivers: int, bucket_mb: int, repeats: int, backend: str, checksum: str = "sampled", adopt: bool = True
) -> list[float]:
    """`adopt`: the sender's tensors move into the channel first, as the learner's parameters do
    (shm only; other channels have nothing resident, so it changes nothing there)."""
    import msgspec

    from async_rl.weight_sync.bucketing import build_manifest
    from async_rl.weight_sync.transport import join_sender, open_membership

    world = receivers + 1
    manifest = build_manifest(state.items(), bucket_mb << 20)
    info, store = open_membership("127.0.0.1", 0, world, 300, backend, manifest, checksum, 1)
    shapes = [(n, tuple(t.shape)) for n, t in state.items()]
    ctx = mp.get_context("spawn")
    args = (msgspec.msgpack.encode(info), shapes, msgspec.msgpack.encode(manifest), repeats)
    procs = [ctx.Process(target=_receiver, args=(args[0], r, *args[1:])) for r in range(1, world)]
    for p in procs:
        p.start()
    sender = join_sender(info, store, manifest)
    if adopt:
        sender.adopt(state)
    times = []
    for v in range(repeats):
        sender.group.barrier()  # everyone ready: time the transfer only
        t0 = time.perf_counter()
        sender.send(state, v)
        sender.group.barrier()  # every receiver has copied everything
        times.append(time.perf_counter() - t0)
    for p in procs:
        p.join()
    return times


# ---- Ray object store ---------------------------------------------------------------------------


class _RayReceiver:
    def __init__(self, shapes) -> None:
        torch.set_num_threads(1)
        self.params = make_state(shapes, fill=0.0)

    def load(self, state_ref_holder: list) -> int:
        import ray

        state = ray.get(state_ref_holder[0])
        for name, t in state.items():
            self.params[name].copy_(t)
        return len(state)


def bench_ray(state, receivers: int, repeats: int) -> list[float]:
    import ray

    ray.init(
        num_cpus=receivers + 1,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=int(nbytes(state) * 1.5) + (256 << 20),
    )
    try:
        shapes = [(n, tuple(t.shape)) for n, t in state.items()]
        actors = [ray.remote(_RayReceiver).options(num_cpus=1).remote(shapes) for _ in range(receivers)]
        ray.get([a.__ray_ready__.remote() for a in actors])
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            ref = ray.put(state)
            ray.get([a.load.remote([ref]) for a in actors])  # wrapped: actors fetch, not the driver
            times.append(time.perf_counter() - t0)
            del ref
        return times
    finally:
        ray.shutdown()


# ---- memcpy ---------------------------------------------------------------------------------------


def bench_memcpy(size: int, repeats: int) -> list[float]:
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return times


def summarize(method: str, size_mb: float, receivers: int, size: int, times: list[float], **extra) -> dict:
    gbps = [size / t / 1e9 for t in times]
    return {
        "method": method,
        "size_mb": size_mb,
        "receivers": receivers,
        "seconds_min": min(times),
        "seconds_median": statistics.median(times),
        "seconds_max": max(times),
        "gbps_per_receiver_min": min(gbps),
        "gbps_per_receiver_median": statistics.median(gbps),
        "gbps_per_receiver_max": max(gbps),
        **extra,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[50, 500, 2000])
    ap.add_argument("--receivers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--backends", nargs="+", default=["gloo", "shm"])
    ap.add_argument("--sweep-size-mb", type=float, default=500)
    ap.add_argument("--sweep-buckets-mb", type=int, nargs="+", default=[4, 16, 64, 256])
    ap.add_argument("--out", default=str(RESULTS / "weight_sync.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []

    def report(row):
        rows.append(row)
        print(
            f"{row['method']:<10} {row['size_mb']:>7.0f} MB {row['receivers']:>2} recv"
            f" {row.get('bucket_mb', ''):>5} {row['seconds_min']:8.3f} {row['seconds_median']:8.3f}"
            f" {row['seconds_max']:8.3f} s  {row['gbps_per_receiver_median']:6.2f} GB/s",
            flush=True,
        )

    print(f"{'method':<10} {'size':>10} {'':>7} {'bucket':>5} {'min':>8} {'median':>8} {'max':>8}      GB/s/receiver")
    for size_mb in args.sizes_mb:
        state = make_state(transformer_shapes(size_mb))
        size = nbytes(state)
        report(summarize("memcpy", size_mb, 0, size, bench_memcpy(size, args.repeats)))
        for receivers in args.receivers:
            for backend in args.backends:
                times = bench_ours(state, receivers, args.bucket_mb, args.repeats, backend)
                report(summarize(f"ours-{backend}", size_mb, receivers, size, times, bucket_mb=args.bucket_mb))
            report(summarize("ray", size_mb, receivers, size, bench_ray(state, receivers, args.repeats)))
        del state
    state = make_state(transformer_shapes(args.sweep_size_mb))
    size = nbytes(state)
    for backend in args.backends:
        for bucket_mb in args.sweep_buckets_mb:
            times = bench_ours(state, 1, bucket_mb, args.repeats, backend)
            report(summarize(f"ours-{backend}", args.sweep_size_mb, 1, size, times, bucket_mb=bucket_mb, sweep=True))
        # The cost of the update checksum ('sampled' is the default in the rows above).
        for mode in ("full", "off"):
            times = bench_ours(state, 1, args.bucket_mb, args.repeats, backend, checksum=mode)
            report(summarize(f"ours-{backend}-ck{mode}", args.sweep_size_mb, 1, size, times, bucket_mb=args.bucket_mb))
        if backend == "shm":  # what keeping the learner's parameters in the mapping saves
            times = bench_ours(state, 1, args.bucket_mb, args.repeats, backend, adopt=False)
            report(summarize("ours-shm-packed", args.sweep_size_mb, 1, size, times, bucket_mb=args.bucket_mb))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__}
    out.write_text(json.dumps({"machine": machine, "repeats": args.repeats, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
