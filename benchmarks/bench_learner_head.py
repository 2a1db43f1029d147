"""The learner head, before and after: one forward+backward of the torch backend on the real preset.

SmolLM2-135M fp32, `--threads` threads (2: this machine), 48 rows (8 prompts x 6 samples) of a
35-token prompt + 64 completion tokens, the loss on the completion tokens: the shape of DESIGN.md's
"Learner cost" numbers (measured by hand: full head 30.3 s, no head 18.8 s). Variants, each in its own
subprocess (so its peak RSS, `ru_maxrss`, is its own):

- full: `learner.logprob_chunk_tokens: 0`, the former path (logits, fp32 log-softmax and entropy at
  every position);
- chunked: the chunked head at the loss positions only (`logprob_chunk_tokens`, default 1024);
- no_head: the trunk alone (a floor: what the step would cost with a free head).

Writes benchmarks/results/learner_head.json and prints a table. CPU-heavy: run it under
/work/bin/heavy on the shared machine.
    python benchmarks/bench_learner_head.py [--repeats 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

PROMPTS, GROUP, PROMPT_LEN, COMPLETION_LEN = 8, 6, 35, 64
RESULTS = Path(__file__).resolve().parent / "results" / "learner_head.json"


def model_dir(name: str = "smollm2-135m") -> str:
    from async_rl.models.tiny import resolve_model_path

    cache = os.environ.get("ASYNC_RL_MODEL_CACHE", str(Path.home() / ".cache" / "async_rl" / "models"))
    return str(resolve_model_path(name, cache))


def batch(vocab: int, seed: int = 0, prompts: int = PROMPTS):
    """The padded micro-batch of 48 rows (all one length: padded and packed are the same here)."""
    import numpy as np

    from async_rl.learner.packing import SeqSample, padded

    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(prompts):
        prompt = rng.integers(10, vocab, PROMPT_LEN)
        for _ in range(GROUP):
            tokens = np.concatenate([prompt, rng.integers(10, vocab, COMPLETION_LEN)])
            zeros = np.zeros(COMPLETION_LEN, np.float32)
            samples.append(SeqSample(tokens, PROMPT_LEN, zeros - 3.0, zeros + 1.0))
    return padded(samples)


def make_step(name: str, model: str):
    """(backend, step(micro-batch) -> seconds) for one variant."""
    import torch

    from async_rl.config import LearnerConfig
    from async_rl.learner.torch_backend import TorchBackend

    torch.manual_seed(0)
    chunk = 0 if name == "full" else LearnerConfig().logprob_chunk_tokens
    backend = TorchBackend(LearnerConfig(logprob_chunk_tokens=chunk), "float32", 0, 1, "")
    backend.setup(model_dir(model))

    def step(m) -> float:
        n_loss = m.loss_tokens
        t0 = time.perf_counter()
        if name == "no_head":  # the trunk and a loss on its output: what a free head would leave
            backend.optimizer.zero_grad(set_to_none=True)
            last = backend.model.base_model(**m.model_inputs(backend.device)).last_hidden_state
            ((last.float().mean(-1) * m.loss_mask).sum() / n_loss).backward()
        else:
            backend.forward_backward([m], 1.0, lambda _i, s: -(s.logp * m.loss_mask).sum() / n_loss)
        return time.perf_counter() - t0

    return backend, step


def run_variant(name: str, repeats: int, threads: int, model: str) -> dict:
    import torch

    from async_rl.config import LearnerConfig

    torch.set_num_threads(threads)
    chunk = 0 if name == "full" else LearnerConfig().logprob_chunk_tokens
    backend, step = make_step(name, model)
    mb = batch(backend.model.config.vocab_size)
    n_loss = mb.loss_tokens
    step(batch(backend.model.config.vocab_size, seed=1, prompts=1))  # warm-up on 6 rows (allocator, kernels)
    times = [step(mb) for _ in range(repeats)]
    grad = [p.grad for p in backend.model.parameters() if p.grad is not None]
    norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grad))) if grad else 0.0
    return {
        "variant": name,
        "chunk": chunk,
        "times_s": times,
        "best_s": min(times),
        "mean_s": sum(times) / len(times),
        "grad_norm": norm,
        "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        "rows": mb.input_ids.shape[0],
        "tokens": int(mb.input_ids.numel()),
        "loss_tokens": n_loss,
        "threads": threads,
        "load_avg_at_end": os.getloadavg(),  # the machine is shared: how busy it was meanwhile
    }


def run_interleaved(names: list[str], repeats: int, threads: int, model: str) -> dict:
    """Every variant in one process, timed in turn (A, B, C, A, B, C, ...): on a shared machine
    whose load drifts, paired times compare better than runs minutes apart."""
    import torch

    torch.set_num_threads(threads)
    steps = {n: make_step(n, model) for n in names}
    vocab = next(iter(steps.values()))[0].model.config.vocab_size
    mb, warm = batch(vocab), batch(vocab, seed=1, prompts=1)
    for _, step in steps.values():
        step(warm)
    times: dict[str, list[float]] = {n: [] for n in names}
    loads = []
    for _ in range(repeats):
        for n in names:
            times[n].append(steps[n][1](mb))
        loads.append(os.getloadavg()[0])
    out = {"times_s": times, "load_avg_1min_per_round": loads}
    if "full" in times and "chunked" in times:
        ratios = sorted(f / c for f, c in zip(times["full"], times["chunked"], strict=True))
        out["paired_ratio_full_over_chunked"] = ratios
        out["median_paired_ratio"] = ratios[len(ratios) // 2]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default="full,chunked,no_head")
    ap.add_argument("--model", default="smollm2-135m", help="model preset (tiny-qwen2: a quick smoke run)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one variant, print its JSON
    ap.add_argument("--interleaved", type=int, default=0,
                    help="then N rounds of every variant in one process, in turn (timing on a loaded machine)")
    ap.add_argument("--skip-separate", action="store_true", help="only the interleaved rounds (no RSS)")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_variant(args.one, args.repeats, args.threads, args.model)))
        return
    model_dir(args.model)  # fetch/convert once, before the timed subprocesses
    rows = []
    for name in [] if args.skip_separate else args.variants.split(","):
        cmd = [sys.executable, __file__, "--one", name, "--repeats", str(args.repeats), "--threads", str(args.threads),
               "--model", args.model]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(f"{name}: {rows[-1]['best_s']:.1f} s", file=sys.stderr, flush=True)
    by = {r["variant"]: r for r in rows}
    load = os.getloadavg()
    result = {
        "what": f"one forward+backward, torch backend, {args.model} fp32, 48 rows x (35 prompt + 64 completion)",
        "uptime_load": load,
        "design_md_baseline_s": {"full": 30.3, "no_head": 18.8},
        "variants": rows,
    }
    if args.interleaved:
        result["interleaved"] = run_interleaved(args.variants.split(","), args.interleaved, args.threads, args.model)
    if "full" in by and "chunked" in by:
        result["speedup_chunked_vs_full"] = by["full"]["best_s"] / by["chunked"]["best_s"]
        result["grad_norm_rel_diff"] = abs(by["full"]["grad_norm"] - by["chunked"]["grad_norm"]) / by["full"]["grad_norm"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'variant':<10} {'best s':>8} {'mean s':>8} {'max RSS GB':>11} {'grad norm':>10}")
    for r in rows:
        print(f"{r['variant']:<10} {r['best_s']:>8.1f} {r['mean_s']:>8.1f} {r['max_rss_gb']:>11.2f} {r['grad_norm']:>10.4f}")
    if args.interleaved:
        inter = result["interleaved"]
        for n, ts in inter["times_s"].items():
            print(f"interleaved {n:<10} " + " ".join(f"{t:6.1f}" for t in ts) + " s")
        if "median_paired_ratio" in inter:
            print(f"interleaved full/chunked, median of paired rounds: {inter['median_paired_ratio']:.2f}x")
    if "speedup_chunked_vs_full" in result:
        print(f"chunked vs full: {result['speedup_chunked_vs_full']:.2f}x faster; load average {load}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
