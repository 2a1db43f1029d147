"""One prompt per group (`learner.share_prompt`), on and off: one learner forward+backward of the torch
backend on the real preset, for the arithmetic and the tool-use batch shapes.

Prompts: the first `prompts_per_step` rows of the config's train file, rendered as a run renders them
(chat template, system prompt, the environment's tool instructions). Completions: random tokens,
`group_size` per prompt; arithmetic 64 tokens each (its max_tokens, what most completions reach);
tool episodes 40-140 tokens with a 12-token environment turn (a tool result, loss mask 0) inside.
Micro-batches by the config's `learner.micro_batch_tokens`. Both layouts run on one backend (same
weights, no optimizer step), timed in turn (off, on, off, on, ...) so that a drifting machine load
hits both alike; the gradients of the two layouts are compared too.

    /work/bin/heavy python benchmarks/bench_share_prompt.py [--rounds 2] [--threads 2]

Writes benchmarks/results/share_prompt.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from async_rl.config import LearnerConfig, load_config
from async_rl.data import load_prompt_files, make_renderer, max_prompt_tokens
from async_rl.learner.batch.packing import MicroBatch, SeqSample, micro_batches
from async_rl.learner.batch.shared_prefix import shared_micro_batches
from async_rl.learner.torch_backend import TorchBackend

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "share_prompt.json"
SHAPES = {"arith": "configs/smollm2_arith.yaml", "tools": "configs/smollm2_tools.yaml"}


def model_dir(name: str) -> str:
    from async_rl.models.tiny import resolve_model_path

    cache = os.environ.get("ASYNC_RL_MODEL_CACHE", str(Path.home() / ".cache" / "async_rl" / "models"))
    return str(resolve_model_path(name, cache))


def batch(shape: str, model: str, seed: int = 0) -> tuple[list[SeqSample], int]:
    """(the samples of one step of `shape`, its micro_batch_tokens)."""
    cfg = load_config(ROOT / SHAPES[shape])
    renderer = make_renderer(cfg, model)
    prompts = load_prompt_files(cfg.data.train_files[:1], cfg.data, renderer, max_prompt_tokens(cfg),
                                "data.train_files").prompts[: cfg.train.prompts_per_step]
    vocab = len(renderer.tokenizer)
    rng = np.random.default_rng(seed)
    samples = []
    for p in prompts:
        prompt = np.asarray(p.token_ids, dtype=np.int64)
        for _ in range(cfg.generators.group_size):
            n = cfg.generators.max_tokens if shape == "arith" else int(rng.integers(40, 141))
            mask = np.ones(n, np.int8)
            if shape == "tools":
                at = int(rng.integers(10, n - 20))
                mask[at : at + 12] = 0  # the tool's result: an environment turn
            tokens = np.concatenate([prompt, rng.integers(10, vocab - 10, n)])
            samples.append(SeqSample(tokens, len(prompt), np.full(n, -2.0, np.float32),
                                     rng.standard_normal(n).astype(np.float32), loss_mask=mask))
    return samples, cfg.learner.micro_batch_tokens


def step(backend: TorchBackend, mbs: list[MicroBatch]) -> tuple[float, dict[str, torch.Tensor]]:
    tokens = max(1, sum(mb.loss_tokens for mb in mbs))
    t0 = time.perf_counter()
    backend.forward_backward(mbs, 1.0, lambda i, s: (s.logp * mbs[i].loss_mask * mbs[i].advantages).sum() / tokens)
    seconds = time.perf_counter() - t0
    return seconds, {n: p.grad for n, p in backend.model.named_parameters() if p.grad is not None}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--shapes", default="arith,tools")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = model_dir(args.model)
    backend = TorchBackend(LearnerConfig(), "float32", 0, 1, "")
    backend.setup(model)
    result: dict = {"model": args.model, "threads": args.threads, "uptime_start": uptime(), "shapes": {}}
    for shape in args.shapes.split(","):
        samples, budget = batch(shape, model)
        c = LearnerConfig(micro_batch_tokens=budget)
        layouts = {
            "off": micro_batches(samples, c.packing, c.micro_batch_size, budget, c.pack_row_tokens),
            "on": shared_micro_batches(samples, c.packing, c.micro_batch_size, budget, c.pack_row_tokens),
        }
        step(backend, layouts["on"][:1])  # warm-up (allocator, kernels)
        times: dict[str, list[float]] = {"off": [], "on": []}
        loads, rel = [], 0.0
        for _ in range(args.rounds):
            grads = {}
            for name, mbs in layouts.items():
                seconds, g = step(backend, mbs)
                times[name].append(seconds)
                grads[name] = {k: v.clone() for k, v in g.items()}
            rel = max(rel, max(float((grads["on"][k] - v).norm() / v.norm().clamp(min=1e-30))
                               for k, v in grads["off"].items()))
            loads.append(os.getloadavg()[0])
        completion = sum(s.completion_len for s in samples)
        row = {
            "samples": len(samples),
            "prompt_tokens_mean": float(np.mean([s.start for s in samples])),
            "completion_tokens": completion,
            "micro_batch_tokens": budget,
            "positions": {k: int(sum(int(mb.input_ids.numel()) for mb in v)) for k, v in layouts.items()},
            "micro_batches": {k: [list(mb.input_ids.shape) for mb in v] for k, v in layouts.items()},
            "times_s": times,
            "paired_ratio_off_over_on": [a / b for a, b in zip(times["off"], times["on"], strict=True)],
            "completion_tokens_per_s": {k: completion / min(v) for k, v in times.items()},
            "grad_rel_diff_max": rel,
            "load_avg_1min_per_round": loads,
        }
        result["shapes"][shape] = row
        print(f"{shape}: {len(samples)} samples, positions off {row['positions']['off']} on {row['positions']['on']}; "
              f"off {times['off']} s, on {times['on']} s; paired off/on {row['paired_ratio_off_over_on']}; "
              f"grad rel diff {rel:.2e}; load {loads}", flush=True)
    result["uptime_end"] = uptime()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['uptime_start']}\n{result['uptime_end']}\nwrote {out}")


if __name__ == "__main__":
    main()
