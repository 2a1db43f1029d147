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

With `--device cuda` the sender's tensors and every receiver's parameters are CUDA tensors on one
GPU (a colocated learner and its generators), and the rows are:

  ours-cuda_ipc   the protocol through one CUDA region mapped by every receiver (IPC handle at join,
                  "bucket k ready" over gloo); the sender's tensors adopted into it. -ckoff: no
                  checksum (the checksum of a CUDA bucket is computed on the device)
  ours-nccl       the NCCL (CuPy) channel; NCCL refuses two ranks on one GPU, so with one GPU the
                  row records that error instead of times
  ours-shm        the protocol through /dev/shm: pack is a device-to-host copy, load a host-to-device one
  pinned-staging  the Ray-style baseline without Ray's serialisation: the sender copies every tensor
                  into one shared host buffer registered as pinned (cudaHostRegister), receivers copy
                  it into their GPU parameters
  device-memcpy   one torch copy_ of the same number of bytes on the GPU: the physical limit

    .venv/bin/python benchmarks/bench_weight_sync.py [--sizes-mb 50 500 2000] [--repeats 3]
    .venv/bin/python benchmarks/bench_weight_sync.py --device cuda --sizes-mb 500 2000 --receivers 1
    .venv/bin/python benchmarks/bench_weight_sync.py --delta [--delta-steps 6] [--backends shm gloo]

`--delta` (weight_sync.delta): SmolLM2-135M (preset smollm2-135m) trained by AdamW (lr 2e-5, clip 1.0,
16 arithmetic answers a step, as benchmarks/bench_delta_density.py), its weights on a bf16 wire to one
receiver process that loads every tensor into its own bf16 parameters. After each optimizer step the
same weights go twice: as a delta against the step before, then full; per step and backend the table
gives the bf16 elements changed, the bytes over the channel and the seconds of each (header to the
barrier after the receiver loaded everything; the delta's time includes finding the changes on the
sender and patching the baseline on the receiver). Writes results/weight_sync_delta.json.

`--dry-run`: one 8 MB state, one receiver, one repetition, no bucket sweep (seconds). Where
`--device cuda` finds no CUDA the last line printed is `SKIP: <reason>` and the exit status 3 (the
convention of every part of `make gpu-check`).
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
EXIT_SKIPPED = 3  # `make gpu-check`: skipped, with the reason on the last line


def cuda_missing() -> str:
    """'' when CUDA is usable; otherwise what is missing (the words of tests/gpu's skips)."""
    if torch.version.cuda is None:
        return f"needs CUDA: torch {torch.__version__} is a CPU build (install the CUDA wheel)"
    if not torch.cuda.is_available():
        return f"needs CUDA: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
    return ""
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


def make_state(shapes, fill: float | None = None, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    return {
        n: (torch.full(s, fill, device=device) if fill is not None else torch.randn(s, generator=g, device=device))
        for n, s in shapes
    }


def synchronize(device: str) -> None:
    """Copies on a GPU are asynchronous: a timing ends when the device has done them."""
    if device == "cuda":
        torch.cuda.synchronize()


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# ---- ours ---------------------------------------------------------------------------------------


def _receiver(info_bytes: bytes, rank: int, shapes, manifest_bytes: bytes, repeats: int, device: str):
    import msgspec

    from async_rl.weight_sync.base import WeightGroupInfo
    from async_rl.weight_sync.bucketing import Manifest
    from async_rl.weight_sync.transport import join_receiver

    torch.set_num_threads(1)
    info = msgspec.msgpack.decode(info_bytes, type=WeightGroupInfo)
    if device == "cuda":  # the sender's GPU (colocated), but an NCCL rank needs a GPU of its own
        torch.cuda.set_device(rank % torch.cuda.device_count() if info.backend == "nccl" else 0)
    params = make_state(shapes, fill=0.0, device=device)
    manifest = msgspec.msgpack.decode(manifest_bytes, type=Manifest)
    receiver = join_receiver(info, rank, manifest)

    def load(named):
        for name, t in named:
            params[name].copy_(t)

    for v in range(repeats):
        receiver.group.barrier()  # matches the sender's "everyone ready" barrier
        receiver.receive(v, load)
        synchronize(device)
        receiver.group.barrier()
    receiver.close()  # the mapping (cuda_ipc) goes before the sender lets go of its region


def bench_ours(
    state,
    receivers: int,
    bucket_mb: int,
    repeats: int,
    backend: str,
    checksum: str = "sampled",
    adopt: bool = True,
    device: str = "cpu",
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
    args = (msgspec.msgpack.encode(info), shapes, msgspec.msgpack.encode(manifest), repeats, device)
    procs = [ctx.Process(target=_receiver, args=(args[0], r, *args[1:])) for r in range(1, world)]
    for p in procs:
        p.start()
    sender = None
    try:
        sender = join_sender(info, store, manifest)
        if adopt:
            # The sender's own copy moves into the mapping (as the learner's parameters do); the
            # caller's tensors stay ordinary memory for the other methods (Ray pickles them).
            state = {n: t.clone() for n, t in state.items()}
            sender.adopt(state)
        times = []
        for v in range(repeats):
            sender.group.barrier()  # everyone ready: time the transfer only
            synchronize(device)
            t0 = time.perf_counter()
            sender.send(state, v)
            sender.group.barrier()  # every receiver has copied everything
            times.append(time.perf_counter() - t0)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():  # the sender failed (e.g. NCCL refused the group): do not wait forever
                p.terminate()
        if sender is not None:
            sender.close()  # frees the exported region (cuda_ipc) now that the receivers are gone
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


# ---- CUDA baselines ---------------------------------------------------------------------------------


def bench_device_memcpy(size: int, repeats: int) -> list[float]:
    src = torch.ones(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def _host_layout(shapes, dtype_size: int = 4) -> tuple[list[tuple[str, tuple[int, ...], int]], int]:
    layout, used = [], 0
    for name, shape in shapes:
        layout.append((name, shape, used))
        used += -(-math.prod(shape) * dtype_size // 64) * 64
    return layout, used


def _map_host(path: str, size: int, pinned: bool) -> tuple[torch.Tensor, bool]:
    """The shared host buffer, registered with CUDA (pinned) when asked and possible."""
    region = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    region[:: os.sysconf("SC_PAGE_SIZE")].zero_()
    if pinned:
        pinned = int(torch.cuda.cudart().cudaHostRegister(region.data_ptr(), size, 1)) == 0  # Portable
    return region, pinned


def _host_views(region: torch.Tensor, layout) -> dict[str, torch.Tensor]:
    return {n: region[o : o + math.prod(s) * 4].view(torch.float32).view(s) for n, s, o in layout}


def _staging_receiver(path: str, shapes, repeats: int, pinned: bool, barrier) -> None:
    torch.cuda.set_device(0)
    layout, size = _host_layout(shapes)
    region, pinned = _map_host(path, size, pinned)
    host = _host_views(region, layout)
    params = make_state(shapes, fill=0.0, device="cuda")
    barrier.wait()  # mapped
    for _ in range(repeats):
        barrier.wait()  # start
        barrier.wait()  # the sender's copy to the host is complete
        for name, t in host.items():
            params[name].copy_(t, non_blocking=pinned)
        torch.cuda.synchronize()
        barrier.wait()  # done


def bench_pinned_staging(state, receivers: int, repeats: int) -> tuple[list[float], bool]:
    """Returns the times and whether the host buffer really was pinned in the sender."""
    from async_rl.weight_sync.shm import new_shm_path

    shapes = [(n, tuple(t.shape)) for n, t in state.items()]
    layout, size = _host_layout(shapes)
    path = new_shm_path("bench-staging")
    with open(path, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, size)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(receivers + 1)
    procs = [ctx.Process(target=_staging_receiver, args=(path, shapes, repeats, True, barrier)) for _ in range(receivers)]
    for p in procs:
        p.start()
    try:
        region, pinned = _map_host(path, size, True)
        host = _host_views(region, layout)
        barrier.wait(timeout=300)
        os.unlink(path)
        times = []
        for _ in range(repeats):
            barrier.wait()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for name, t in state.items():
                host[name].copy_(t, non_blocking=pinned)
            torch.cuda.synchronize()
            barrier.wait()
            barrier.wait()
            times.append(time.perf_counter() - t0)
    finally:
        if os.path.exists(path):
            os.unlink(path)
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    return times, pinned


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


def run_cpu(args, report) -> None:
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


def run_cuda(args, report, failed) -> None:
    """One GPU: the sender in this process, receivers in processes of their own on the same device."""
    torch.cuda.set_device(0)
    for size_mb in args.sizes_mb:
        state = make_state(transformer_shapes(size_mb), device="cuda")
        size = nbytes(state)
        report(summarize("device-memcpy", size_mb, 0, size, bench_device_memcpy(size, args.repeats)))
        for receivers in args.receivers:
            for backend in args.backends:
                method = f"ours-{backend}"
                try:
                    times = bench_ours(state, receivers, args.bucket_mb, args.repeats, backend, device="cuda")
                except Exception as e:  # noqa: BLE001 - e.g. NCCL with two ranks on one GPU: record it
                    failed(method, size_mb, receivers, e)
                    continue
                report(summarize(method, size_mb, receivers, size, times, bucket_mb=args.bucket_mb))
                if backend == "cuda_ipc":  # what the (device-side) checksum costs
                    times = bench_ours(
                        state, receivers, args.bucket_mb, args.repeats, backend, checksum="off", device="cuda"
                    )
                    report(summarize(f"{method}-ckoff", size_mb, receivers, size, times, bucket_mb=args.bucket_mb))
            times, pinned = bench_pinned_staging(state, receivers, args.repeats)
            report(summarize("pinned-staging", size_mb, receivers, size, times, pinned=pinned))
        del state
        torch.cuda.empty_cache()
    if "cuda_ipc" in args.backends:
        state = make_state(transformer_shapes(args.sweep_size_mb), device="cuda")
        size = nbytes(state)
        for bucket_mb in args.sweep_buckets_mb:
            times = bench_ours(state, 1, bucket_mb, args.repeats, "cuda_ipc", checksum="off", device="cuda")
            report(summarize("ours-cuda_ipc-ckoff", args.sweep_size_mb, 1, size, times, bucket_mb=bucket_mb, sweep=True))


# ---- weight_sync.delta on a real model ----------------------------------------------------------


def _delta_receiver(info_bytes: bytes, rank: int, manifest_bytes: bytes, updates: int) -> None:
    import msgspec

    from async_rl.weight_sync.base import WeightGroupInfo
    from async_rl.weight_sync.bucketing import Manifest
    from async_rl.weight_sync.delta import baseline_like
    from async_rl.weight_sync.transport import join_receiver

    torch.set_num_threads(1)
    info = msgspec.msgpack.decode(info_bytes, type=WeightGroupInfo)
    manifest = msgspec.msgpack.decode(manifest_bytes, type=Manifest)
    params = baseline_like(manifest)  # the engine's weights (what vLLM's reload copies into)
    receiver = join_receiver(info, rank, manifest)

    def load(named):
        for name, t in named:
            params[name].copy_(t)

    for v in range(updates):
        receiver.group.barrier()
        receiver.receive(v, load)
        receiver.group.barrier()
    receiver.close()


def smollm2_steps(steps: int) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """SmolLM2-135M's weights before and after each of `steps` AdamW steps (fp32 master weights, kept
    as their bf16 rounding: what the wire carries), and each step's loss."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_delta_density import batch
    from bench_engine_dtype import PROMPTS, smollm2_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    model_dir = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]

    def served() -> dict[str, torch.Tensor]:  # the HF names the learner sends; tied weights once
        return {n: p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters()}

    states, losses = [served()], []
    for step in range(steps):
        out = model(**batch(tok, rows[step * 16 : (step + 1) * 16]))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        states.append(served())
        losses.append(float(out.loss.detach()))
        print(f"trained step {step + 1}: loss {losses[-1]:.3f}", flush=True)
    torch.set_num_threads(1)
    return states, losses


def bench_delta_backend(states: list[dict[str, torch.Tensor]], backend: str, bucket_mb: int) -> list[dict]:
    """Version 0: the initial weights, full. Then per step: the step's weights as a delta, then full."""
    import msgspec

    from async_rl.weight_sync.bucketing import build_manifest
    from async_rl.weight_sync.transport import join_sender, open_membership

    manifest = build_manifest(states[0].items(), bucket_mb << 20, torch.bfloat16)
    updates = 1 + 2 * (len(states) - 1)
    info, store = open_membership("127.0.0.1", 0, 2, 300, backend, manifest, "sampled", 1, delta=True)
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_delta_receiver, args=(msgspec.msgpack.encode(info), 1, msgspec.msgpack.encode(manifest), updates))
    proc.start()
    rows = []
    sender = None
    try:
        sender = join_sender(info, store, manifest)

        def timed(state, version, full):
            sender.group.barrier()
            t0 = time.perf_counter()
            receipt = sender.send(state, version, full=full)
            sender.group.barrier()
            return receipt, time.perf_counter() - t0

        timed(states[0], 0, True)
        for step in range(1, len(states)):
            before, after = states[step - 1], states[step]
            changed = sum(int((after[n].view(torch.int16) != before[n].view(torch.int16)).sum()) for n in after)
            elements = sum(t.numel() for t in after.values())
            delta, delta_s = timed(after, 2 * step - 1, False)
            full, full_s = timed(after, 2 * step, True)
            assert delta.delta and not full.delta
            rows.append({
                "backend": backend, "step": step, "density": changed / elements, "delta_bytes": delta.sent_bytes,
                "full_bytes": full.sent_bytes, "bytes_ratio": delta.sent_bytes / full.sent_bytes,
                "delta_s": delta_s, "full_s": full_s, "time_ratio": delta_s / full_s,
            })
            r = rows[-1]
            print(f"{backend:<5} step {step}: changed {r['density']:.2%} | delta {r['delta_bytes'] / 2**20:7.1f} MiB "
                  f"{r['delta_s']:.3f} s | full {r['full_bytes'] / 2**20:7.1f} MiB {r['full_s']:.3f} s | bytes "
                  f"{r['bytes_ratio']:.1%} time {r['time_ratio']:.2f}x", flush=True)
    finally:
        proc.join(timeout=120)
        if proc.is_alive():
            proc.terminate()
        if sender is not None:
            sender.close()
    return rows


def run_delta(args) -> None:
    states, losses = smollm2_steps(args.delta_steps)
    rows = []
    for backend in args.backends or ["shm", "gloo"]:
        rows += bench_delta_backend(states, backend, args.bucket_mb)
    out = Path(args.out or RESULTS / "weight_sync_delta.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__}
    command = "benchmarks/bench_weight_sync.py --delta --delta-steps " + str(args.delta_steps)
    out.write_text(json.dumps({"command": command, "machine": machine, "model": "smollm2-135m", "wire": "bfloat16",
                               "bucket_mb": args.bucket_mb, "lr": 2e-5, "losses": losses, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the tensors live")
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[50, 500, 2000])
    ap.add_argument("--receivers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--backends", nargs="+", help="default: gloo shm (cpu); cuda_ipc nccl shm (cuda)")
    ap.add_argument("--sweep-size-mb", type=float, default=500)
    ap.add_argument("--sweep-buckets-mb", type=int, nargs="*", default=[4, 16, 64, 256], help="none: no sweep")
    ap.add_argument("--out", help="default: results/weight_sync.json (cpu), results/weight_sync_cuda.json (cuda)")
    ap.add_argument("--dry-run", action="store_true", help="8 MB, 1 receiver, 1 repetition, no sweep: seconds")
    ap.add_argument("--delta", action="store_true", help="weight_sync.delta on SmolLM2-135M (bf16 wire): delta vs full")
    ap.add_argument("--delta-steps", type=int, default=6, help="--delta: optimizer steps measured")
    args = ap.parse_args()
    if args.delta:
        run_delta(args)
        return
    cuda = args.device == "cuda"
    if cuda and (missing := cuda_missing()):
        print(f"SKIP: {missing}", flush=True)
        raise SystemExit(EXIT_SKIPPED)
    if args.dry_run:
        args.sizes_mb, args.receivers, args.repeats, args.sweep_buckets_mb = [8], [1], 1, []
    args.backends = args.backends or (["cuda_ipc", "nccl", "shm"] if cuda else ["gloo", "shm"])
    torch.set_num_threads(1)
    rows = []

    def report(row):
        rows.append(row)
        print(
            f"{row['method']:<20} {row['size_mb']:>7.0f} MB {row['receivers']:>2} recv"
            f" {row.get('bucket_mb', ''):>5} {row['seconds_min']:8.3f} {row['seconds_median']:8.3f}"
            f" {row['seconds_max']:8.3f} s  {row['gbps_per_receiver_median']:6.2f} GB/s",
            flush=True,
        )

    def failed(method: str, size_mb: float, receivers: int, error: Exception) -> None:
        rows.append({"method": method, "size_mb": size_mb, "receivers": receivers, "error": repr(error)})
        print(f"{method:<20} {size_mb:>7.0f} MB {receivers:>2} recv  failed: {error!r}", flush=True)

    print(f"{'method':<20} {'size':>10} {'':>7} {'bucket':>5} {'min':>8} {'median':>8} {'max':>8}      GB/s/receiver")
    if cuda:
        run_cuda(args, report, failed)
    else:
        run_cpu(args, report)
    out = Path(args.out or RESULTS / ("weight_sync_cuda.json" if cuda else "weight_sync.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__}
    if cuda:
        machine.update(device=torch.cuda.get_device_name(0), cuda=torch.version.cuda, gpus=torch.cuda.device_count())
    out.write_text(
        json.dumps({"machine": machine, "device": args.device, "repeats": args.repeats, "rows": rows}, indent=2)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
