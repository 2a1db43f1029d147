"""Per-rank activation memory of one long sequence at learner.sequence_parallel_size 1 and 2 (CPU, gloo).

Each setting runs in fresh processes (SP ranks over gloo): the torch backend on the `tiny-qwen2-wide`
preset (4 layers, hidden 512, 8 heads, 4 K/V heads) or another preset, one packed micro-batch holding
one sequence of `--length` tokens, a warm-up forward/backward, then the measured one. Per rank:

- saved activations: the bytes autograd keeps for backward during the forward (every saved tensor's
  storage counted once, the parameters' own left out; `torch.autograd.graph.saved_tensors_hooks`):
  what sequence parallelism divides;
- peak RSS growth of the step over the rank's resident size before it (VmHWM reset through
  /proc/self/clear_refs), which also holds the weights' gradients, the attention's temporaries and the
  allocator's slack;
- the step's wall time.

    PYTHONPATH=$PWD /tmp/heavy python benchmarks/bench_sequence_parallel.py --length 4096 8192 \
        --out benchmarks/results/sequence_parallel_cpu

Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

from async_rl.cluster.net import free_port


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def _rank(rank: int, sp: int, port: int, model_dir: str, length: int, out: str) -> None:
    from async_rl.config import LearnerConfig
    from async_rl.learner.batch.packing import SeqSample, packed
    from async_rl.learner.torch_backend import TorchBackend

    torch.set_num_threads(1)
    cfg = LearnerConfig(sequence_parallel_size=sp, micro_batch_tokens=0)
    backend = TorchBackend(cfg, "float32", rank, sp, f"127.0.0.1:{port}")
    backend.setup(model_dir)
    rng = np.random.default_rng(0)
    prompt = 64
    sample = SeqSample(tokens=rng.integers(3, backend.model.config.vocab_size, length).astype(np.int64), start=prompt,
                       behav_logp=np.full(length - prompt, -3.0, np.float32),
                       advantages=rng.standard_normal(length - prompt).astype(np.float32))
    mb = packed([sample]).to(backend.device)

    def loss_fn(i, scores):
        return -(scores.logp * mb.advantages * mb.loss_mask).sum() / max(1.0, float(mb.loss_mask.sum()))

    saved: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in backend.model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in weights:  # a linear layer saves its weight too: not an activation
            saved[s.data_ptr()] = s.nbytes()
        return t

    backend.forward_backward([mb], 1.0, loss_fn)  # warm-up
    backend.drop_gradients()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _rss_kb("VmRSS")
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        backend.forward_backward([mb], 1.0, loss_fn)
    step_s = time.perf_counter() - t0
    result = {"rank": rank, "saved_bytes": sum(saved.values()), "peak_growth_bytes": (_rss_kb("VmHWM") - before) * 1024,
              "step_s": step_s}
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    backend.shutdown()


def measure(sp: int, model_dir: str, length: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(sp, free_port(), model_dir, length, out), nprocs=sp, join=True)
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(sp)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny-qwen2-wide")
    p.add_argument("--length", type=int, nargs="+", default=[4096])
    p.add_argument("--sp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--out", default="benchmarks/results/sequence_parallel_cpu")
    args = p.parse_args()
    from async_rl.models.tiny import resolve_model_path

    model_dir = str(resolve_model_path(args.preset, tempfile.mkdtemp(prefix="sp-bench-")))
    rows = []
    for length in args.length:
        for sp in args.sp:
            ranks = measure(sp, model_dir, length)
            row = {"length": length, "sp": sp, "ranks": ranks,
                   "saved_mib": max(r["saved_bytes"] for r in ranks) / 2**20,
                   "peak_growth_mib": max(r["peak_growth_bytes"] for r in ranks) / 2**20,
                   "step_s": max(r["step_s"] for r in ranks)}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "ranks"}), flush=True)
    lines = [f"# Sequence parallelism on CPU: per-rank memory of one long sequence ({args.preset}, fp32, gloo)", "",
             "| tokens | SP | saved activations per rank, MiB | vs SP=1 | peak RSS growth per rank, MiB | vs SP=1 "
             "| step s (slowest rank) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        base = next(r for r in rows if r["length"] == row["length"] and r["sp"] == args.sp[0])
        lines.append(f"| {row['length']} | {row['sp']} | {row['saved_mib']:.1f} | {row['saved_mib'] / base['saved_mib']:.2f} "
                     f"| {row['peak_growth_mib']:.1f} | {row['peak_growth_mib'] / base['peak_growth_mib']:.2f} "
                     f"| {row['step_s']:.2f} |")
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    Path(f"{args.out}.json").write_text(json.dumps({"preset": args.preset, "rows": rows}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
