"""Straggler ratio of a long-tailed batch dealt to data-parallel learner ranks by tokens and by cost.

A step's groups go to the DP ranks in equal counts, largest first to the least-loaded rank
(`buffer/balance.py`); a group's load is its tokens (`attention_weight` 0, the former dealing) or its
learner FLOPs, tokens plus attention's L^2 share (`models.shape.sequence_cost`, the weight read from
the model's shape: what the buffer uses). The batch is long-tailed: samples of about `--median`
tokens, and a few (`--long` of them) 16x that. Each rank's shard is then trained for real, one at a
time in this process (the torch backend, one forward and backward of its packed micro-batches, the
best of `--repeats`), and the straggler ratio is the slowest rank's step over the mean of the ranks'
steps: what a synchronous step waits for.

    PYTHONPATH=$PWD /tmp/heavy python benchmarks/bench_straggler.py --out benchmarks/results/straggler_cpu

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


def step_seconds(backend, shard: list, repeats: int, row_tokens: int) -> float:
    """One forward and backward of the shard's packed micro-batches (8,192 tokens each, rows of
    `row_tokens`: on CPU's SDPA a packed row costs its width squared, so short samples share short rows
    and a long one has its own), best of `repeats`."""
    from async_rl.learner.batch.packing import micro_batches
    from async_rl.learner.driver import shard_samples

    samples = shard_samples(shard)
    rng = np.random.default_rng(0)
    for s in samples:
        s.advantages = rng.standard_normal(s.completion_len).astype(np.float32)
    mbs = [mb.to(backend.device) for mb in micro_batches(samples, True, 0, 8192, row_tokens)]

    def loss_fn(i, scores):
        mb = mbs[i]
        return -(scores.logp * mb.advantages * mb.loss_mask).sum() / 1000.0

    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        backend.forward_backward(mbs, 1.0, loss_fn)
        best = min(best, time.perf_counter() - t0)
        backend.drop_gradients()
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny-qwen2-wide")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--median", type=int, default=128)
    p.add_argument("--long", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/straggler_cpu")
    args = p.parse_args()
    from async_rl.buffer.balance import balanced_shards, group_cost
    from async_rl.config import LearnerConfig
    from async_rl.learner.torch_backend import TorchBackend
    from async_rl.models.shape import ModelShape
    from async_rl.models.tiny import resolve_model_path

    torch.set_num_threads(1)
    model_dir = str(resolve_model_path(args.preset, tempfile.mkdtemp(prefix="straggler-")))
    backend = TorchBackend(LearnerConfig(micro_batch_tokens=8192), "float32", 0, 1, "")
    backend.setup(model_dir)
    weight = ModelShape.read(model_dir).attention_weight()
    batch = long_tailed_batch(args.groups, args.group_size, args.median, args.long,
                              int(backend.model.config.vocab_size), args.seed)
    step_seconds(backend, batch[:1], 1, 2 * args.median)  # warm-up
    rows = []
    for name, w in (("tokens", 0.0), ("cost", weight)):
        shards = balanced_shards(batch, args.ranks, w)
        times = [step_seconds(backend, shard, args.repeats, 2 * args.median) for shard in shards]
        row = {"dealt_by": name, "attention_weight": w, "rank_step_s": times,
               "rank_tokens": [int(sum(group_cost(g, 0.0) for g in s)) for s in shards],
               "rank_cost": [sum(group_cost(g, weight) for g in s) for s in shards],
               "straggler_ratio": max(times) / float(np.mean(times))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    lengths = sorted(len(g.prompt_tokens) + len(c) for g in batch for c in g.completions)
    lines = [f"# Straggler ratio: a long-tailed batch over {args.ranks} data-parallel ranks ({args.preset}, fp32, CPU)", "",
             f"{args.groups} groups x {args.group_size} samples, sequence lengths median {lengths[len(lengths) // 2]}, "
             f"max {lengths[-1]} ({args.long} samples 16x the median completion); attention_weight {weight:.3g}; "
             "each rank's shard timed in turn, one forward and backward, best of "
             f"{args.repeats}.", "",
             "| groups dealt by | tokens per rank | step s per rank | slowest / mean |", "| --- | --- | --- | --- |"]
    for row in rows:
        lines.append(f"| {row['dealt_by']} | {', '.join(str(t) for t in row['rank_tokens'])} "
                     f"| {', '.join(f'{t:.2f}' for t in row['rank_step_s'])} | **{row['straggler_ratio']:.2f}** |")
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    Path(f"{args.out}.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print("\n".join(lines))
    backend.shutdown()


if __name__ == "__main__":
    main()
