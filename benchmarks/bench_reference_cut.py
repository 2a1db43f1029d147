"""The KL reference pass on a long-tailed shard: its padded rows cut by tokens against cut by the learner's
cost model (`learner/batch/cut.py`, `MicroBatchCut.padded_rows`), CPU seconds of one thread.

The shard is `bench_straggler.py`'s long-tailed batch as one rank's padded shard; the reference model
(`ReferencePolicy`) scores it under `learner.micro_batch_tokens` 8192 with the cut's cost model on the
`dense` path (HF's SDPA under the padding mask), or with none (tokens alone). The arms are interleaved,
best of `--repeats`; the log-probs of the two arms are compared too.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/bench_reference_cut.py --out benchmarks/results/reference_cut_cpu

Writes OUT.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.bench_straggler import batch_arguments, long_tailed_batch, one_thread_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    batch_arguments(p)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/reference_cut_cpu")
    args = p.parse_args()
    from async_rl.learner.batch.cut import MicroBatchCut
    from async_rl.learner.batch.padded import PaddedShard
    from async_rl.learner.rl.reference import ReferencePolicy
    from async_rl.models.cost import CostModel
    from async_rl.models.shape import ModelShape

    model_dir, started = one_thread_model(args.preset)
    cost = CostModel(attention_weight=ModelShape.read(model_dir).attention_weight(), path="dense")
    arms = {name: ReferencePolicy(model_dir, torch.float32, cut=MicroBatchCut(cost=c, max_tokens=8192))
            for name, c in (("tokens", None), ("cost", cost))}
    vocab = int(arms["cost"].model.config.vocab_size)
    shard = PaddedShard(long_tailed_batch(args.groups, args.group_size, args.median, args.long, vocab, 0))
    lengths = [int(n) for n in shard.attention_mask.sum(dim=1)]
    best, scores = dict.fromkeys(arms, float("inf")), {}
    for _ in range(args.repeats):
        for name, ref in arms.items():
            t = time.process_time()
            scores[name] = ref.score(shard, 1.0)
            best[name] = min(best[name], time.process_time() - t)
    diff = float((scores["cost"] - scores["tokens"]).abs().max())
    command = ("OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/bench_reference_cut.py "
               + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()))
    lines = [f"# The KL reference pass cut by tokens and by cost ({args.preset}, fp32, CPU, one thread)", "",
             f"{started}. One padded shard of {len(lengths)} rows, lengths median {sorted(lengths)[len(lengths) // 2]}, "
             f"max {max(lengths)}, {sum(lengths)} tokens; micro_batch_tokens 8192; best of {args.repeats}, arms "
             "interleaved; the machine shared with other runs.", "", "    " + command, "",
             "| cut by | micro-batches (rows x width) | CPU s |", "| --- | --- | --- |"]
    for name, ref in arms.items():
        rows = ref.cut.padded_rows(lengths, "dense")
        shapes = " + ".join(f"{len(g)}x{max(lengths[i] for i in g)}" for g in rows)
        lines.append(f"| {name} | {shapes} | {best[name]:.2f} |")
    lines += ["", f"By cost {best['tokens'] / best['cost']:.2f}x faster; largest log-prob difference {diff:.2g}."]
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
