"""Straggler ratio of a long-tailed batch over data-parallel learner ranks: dealt and cut by tokens
against dealt and cut by the learner's cost estimate (`models/cost.py`).

A step's groups go to the DP ranks in equal counts, largest first to the least-loaded rank
(`buffer/balance.py`). Arm `tokens`: a group's load is its tokens and each rank's shard is cut into
micro-batches by tokens (the former learner). Arm `cost`: the load is `CostModel.sample` of the
attention path the backend runs (SDPA on CPU: `dense`), and the shard's token cut is cut again by the
executed cost (`packing.cost_cut`), as the driver does. The batch is long-tailed: completions of about
`--median` tokens (+-50%) and `--long` of them 16x that. Each rank's shard is trained for real, one at
a time in this process (the torch backend, one forward and backward of its packed micro-batches in
rows of `--row-tokens`), the arms interleaved rank by rank within every repeat so that the machine's
load hits both alike; each rank's best of `--repeats` counts. The straggler ratio is the slowest
rank's step over the mean of the ranks' steps: what a synchronous step waits for. CPU seconds
(the process's, one thread) are what compares on a loaded machine; wall seconds are recorded beside
them, and the load average before and after every repeat.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/bench_straggler.py --out benchmarks/results/straggler_cpu

Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def long_tailed_batch(groups: int, group_size: int, median: int, long: int, vocab: int, seed: int) -> list:
    """`groups` prompt groups; completions around `median` tokens (+-50%), `long` of them 16x `median`."""
    from async_rl.protocol import TrajectoryGroup

    rng = np.random.default_rng(seed)
    lengths = rng.integers(median // 2, median * 3 // 2, size=(groups, group_size))
    for i in rng.choice(groups * group_size, size=long, replace=False):
        lengths.flat[i] = 16 * median
    out = []
    for g in range(groups):
        comps = [rng.integers(3, vocab, int(n)).astype(np.int32) for n in lengths[g]]
        out.append(TrajectoryGroup(
            prompt_id=g, engine_id=0, prompt_tokens=rng.integers(3, vocab, 32).astype(np.int32), completions=comps,
            logprobs=[np.full(len(c), -3.0, np.float32) for c in comps], rewards=[float(r) for r in rng.random(group_size)],
            version_first=[0] * group_size, version_last=[0] * group_size, reward_status=[0] * group_size,
        ))
    return out


def shard_micro_batches(backend, shard: list, row_tokens: int, cost) -> list:
    """The shard's packed micro-batches (8,192 tokens each, rows of `row_tokens`), cut again by `cost`
    (None: by tokens alone), with random advantages."""
    from async_rl.learner.batch.packing import micro_batches
    from async_rl.learner.driver import shard_samples

    samples = shard_samples(shard)
    rng = np.random.default_rng(0)
    for s in samples:
        s.advantages = rng.standard_normal(s.completion_len).astype(np.float32)
    return [mb.to(backend.device) for mb in micro_batches(samples, True, 0, 8192, row_tokens, cost)]


def step_seconds(backend, mbs: list) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one forward and backward of `mbs`."""
    def loss_fn(i, scores):
        mb = mbs[i]
        return -(scores.logp * mb.advantages * mb.loss_mask).sum() / 1000.0

    c0, t0 = time.process_time(), time.perf_counter()
    backend.forward_backward(mbs, 1.0, loss_fn)
    out = time.process_time() - c0, time.perf_counter() - t0
    backend.drop_gradients()
    return out


def batch_arguments(p: argparse.ArgumentParser) -> None:
    """The model and the long-tailed batch's arguments (`long_tailed_batch`), shared with bench_reference_cut.py."""
    p.add_argument("--preset", default="tiny-qwen2-wide")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--median", type=int, default=64)
    p.add_argument("--long", type=int, default=3)


def one_thread_model(preset: str) -> tuple[str, str]:
    """One torch thread, the preset's model folder written to a fresh temporary folder, and the start time."""
    from async_rl.models.tiny import resolve_model_path

    torch.set_num_threads(1)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return str(resolve_model_path(preset, tempfile.mkdtemp(prefix="bench-"))), started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    batch_arguments(p)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--row-tokens", type=int, default=256, help="learner.pack_row_tokens (CPU: keep rows short)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/straggler_cpu")
    args = p.parse_args()
    from async_rl.buffer.balance import balanced_shards, group_cost
    from async_rl.config import LearnerConfig
    from async_rl.learner.torch_backend import TorchBackend
    from async_rl.models.cost import TOKENS, CostModel
    from async_rl.models.shape import ModelShape

    model_dir, started = one_thread_model(args.preset)
    backend = TorchBackend(LearnerConfig(micro_batch_tokens=8192, pack_row_tokens=args.row_tokens), "float32", 0, 1, "")
    backend.setup(model_dir)
    cost = CostModel(attention_weight=ModelShape.read(model_dir).attention_weight(), path=backend.attention_path,
                     row_tokens=args.row_tokens)
    batch = long_tailed_batch(args.groups, args.group_size, args.median, args.long,
                              int(backend.model.config.vocab_size), args.seed)
    step_seconds(backend, shard_micro_batches(backend, batch[:1], args.row_tokens, None))  # warm-up
    arms = {"tokens": (TOKENS, None), "cost": (cost, cost)}  # (dealt by, cut by)
    plans = {}
    for name, (dealt_by, cut_by) in arms.items():
        shards = balanced_shards(batch, args.ranks, dealt_by)
        mbs = [shard_micro_batches(backend, shard, args.row_tokens, cut_by) for shard in shards]
        plans[name] = {"shards": shards, "mbs": mbs}
    times = {name: [[] for _ in range(args.ranks)] for name in arms}
    loads = []
    for _ in range(args.repeats):
        before = os.getloadavg()[0]
        for r in range(args.ranks):
            for name in arms:  # interleaved: rank r by tokens, then by cost
                times[name][r].append(step_seconds(backend, plans[name]["mbs"][r]))
        loads.append((before, os.getloadavg()[0]))
    rows = []
    for name in arms:
        shards, mbs = plans[name]["shards"], plans[name]["mbs"]
        cpu = [min(t[0] for t in ts) for ts in times[name]]
        wall = [min(t[1] for t in ts) for ts in times[name]]
        executed = [sum(cost.layout(mb.segments.layout()) for mb in rank_mbs) for rank_mbs in mbs]
        row = {
            "arm": name, "rank_cpu_s": cpu, "rank_wall_s": wall, "all_cpu_wall_s": times[name],
            "rank_tokens": [int(sum(group_cost(g) for g in s)) for s in shards],
            "rank_dealt_estimate": [sum(group_cost(g, cost) for g in s) for s in shards],
            "rank_executed_estimate": executed,
            "rank_positions": [sum(mb.input_ids.numel() for mb in rank_mbs) for rank_mbs in mbs],
            "rank_micro_batches": [[list(mb.input_ids.shape) for mb in rank_mbs] for rank_mbs in mbs],
            "straggler_ratio_cpu": max(cpu) / float(np.mean(cpu)),
            "straggler_ratio_wall": max(wall) / float(np.mean(wall)),
            "straggler_ratio_estimated": max(executed) / float(np.mean(executed)),
            "slowest_cpu_s": max(cpu),
        }
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "all_cpu_wall_s"}), flush=True)
    lengths = sorted(len(g.prompt_tokens) + len(c) for g in batch for c in g.completions)
    command = ("OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/bench_straggler.py "
               + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()))
    lines = [f"# Straggler ratio: a long-tailed batch over {args.ranks} data-parallel ranks ({args.preset}, fp32, CPU)", "",
             f"{started}. {args.groups} groups x {args.group_size} samples, sequence lengths median "
             f"{lengths[len(lengths) // 2]}, max {lengths[-1]} ({args.long} samples 16x the median completion); "
             f"micro_batch_tokens 8192, rows of {args.row_tokens}; attention path `{cost.path}` (SDPA), "
             f"attention_weight {cost.attention_weight:.3g}. Each rank's shard trained in turn (one forward and "
             f"backward, one thread), the two arms interleaved rank by rank, best of {args.repeats}. Load average "
             "(1 min) before / after each repeat: " + ", ".join(f"{a:.1f} / {b:.1f}" for a, b in loads)
             + " on 2 cores (the lead's learning runs held both).", "", "    " + command, "",
             "| arm (dealt and cut by) | tokens per rank | micro-batches per rank (rows x width) | CPU s per rank "
             "| estimated cost per rank | slowest / mean, CPU s | wall s | estimated |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        shapes = "; ".join(" + ".join(f"{a}x{b}" for a, b in rank) for rank in row["rank_micro_batches"])
        lines.append(
            f"| {row['arm']} | {', '.join(str(t) for t in row['rank_tokens'])} | {shapes} "
            f"| {', '.join(f'{t:.2f}' for t in row['rank_cpu_s'])} "
            f"| {', '.join(f'{c:.0f}' for c in row['rank_executed_estimate'])} "
            f"| **{row['straggler_ratio_cpu']:.2f}** | {row['straggler_ratio_wall']:.2f} "
            f"| {row['straggler_ratio_estimated']:.2f} |")
    a, b = rows
    lines += ["", f"Slowest rank: {a['slowest_cpu_s']:.2f} CPU s by tokens, {b['slowest_cpu_s']:.2f} by cost "
              f"({a['slowest_cpu_s'] / b['slowest_cpu_s']:.2f}x); summed over ranks {sum(a['rank_cpu_s']):.2f} "
              f"against {sum(b['rank_cpu_s']):.2f}."]
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    Path(f"{args.out}.json").write_text(json.dumps({"command": command, "started": started, "load_avg": loads,
                                                    "args": vars(args), "rows": rows}, indent=1))
    print("\n".join(lines))
    backend.shutdown()


if __name__ == "__main__":
    main()
