"""LoRA (learner.lora) against full fine-tuning on smollm2-135m (fp32, CPU): what one weight sync moves
and how long it takes, and the learner's peak memory and tokens/s.

  sync     the update each sync sends (adapter tensors vs every weight), its bytes, and the time of one
           update through our weight transport (gloo group, 1 receiver thread that copies what it
           receives, as vLLM's loader does; checksum 'sampled', the default), median of --repeats
  learner  one learner rank (torch backend, no DDP) trains --steps batches of synthetic GRPO groups
           (8 prompts x 4 completions, 32-token prompts, 64-token completions); each mode runs in its
           own process: peak RSS (ru_maxrss) after setup and after training, tokens/s of the steps
           after the first

    python benchmarks/bench_lora.py [--repeats 3] [--steps 3] [--rank 16]

The vLLM-vs-learner mismatch with the adapter is measured by tests/integration/test_lora_real.py
(logprob_mismatch after every sync) and reported with these numbers (benchmarks/results/lora.md).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO))

PROMPTS, GROUP, PROMPT_TOKENS, COMPLETION_TOKENS = 8, 4, 32, 64


def model_dir() -> str:
    from async_rl.models.tiny import resolve_model_path

    return str(resolve_model_path("smollm2-135m", "~/.cache/async_rl/models"))


def make_rank(lora_rank: int):
    """A learner rank on smollm2; lora_rank 0 = full fine-tuning."""
    from async_rl.config import LoraConfig
    from async_rl.learner.driver import LearnerDriver
    from tests.unit._learner_fixtures import settings

    lora = LoraConfig(enabled=lora_rank > 0, rank=max(1, lora_rank), alpha=2.0 * max(1, lora_rank))
    rank = LearnerDriver(settings(model_dir(), lora=lora, lr=1e-5, micro_batch_tokens=2048), 0, 1, "", [])
    rank.setup()
    return rank


def synthetic_groups(seed: int):
    from async_rl.protocol import TrajectoryGroup

    rng = np.random.default_rng(seed)
    out = []
    for gi in range(PROMPTS):
        comps = [rng.integers(10, 49_000, COMPLETION_TOKENS).astype(np.int32) for _ in range(GROUP)]
        out.append(TrajectoryGroup(
            prompt_id=gi, engine_id=0, prompt_tokens=rng.integers(10, 49_000, PROMPT_TOKENS).astype(np.int32),
            completions=comps, logprobs=[np.full(COMPLETION_TOKENS, -3.0, dtype=np.float32) for _ in comps],
            rewards=[float(r) for r in rng.random(GROUP)], version_first=[0] * GROUP, version_last=[0] * GROUP,
            reward_status=[0] * GROUP,
        ))
    return out


def time_update(tensors: dict, repeats: int) -> tuple[int, float]:
    """(bytes, median seconds) of one update of `tensors` over a gloo group to one receiver thread."""
    from async_rl.weight_sync.bucketing import build_manifest
    from async_rl.weight_sync.transport import join_receiver, join_sender, open_membership

    manifest = build_manifest(tensors.items(), bucket_bytes=64 << 20)
    info, store = open_membership("127.0.0.1", 0, 2, 120, "gloo", manifest, "sampled", 1)

    def receive():
        rx = join_receiver(info, 1, manifest)
        for v in range(1, repeats + 1):
            rx.receive(v, lambda it: [t.clone() for _, t in it])

    times = []
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(receive)
        sender = join_sender(info, store, manifest)
        for v in range(1, repeats + 1):
            t0 = time.perf_counter()
            sender.send(tensors, v)
            times.append(time.perf_counter() - t0)
        fut.result(timeout=600)
    return manifest.total_bytes, statistics.median(times)


def bench_sync(lora_rank: int, repeats: int) -> dict:
    import torch

    with torch.no_grad():
        full = make_rank(0)
        full_bytes, full_s = time_update(dict(full.backend.hf_weights()), repeats)
        del full
        lora = make_rank(lora_rank)
        tensors = lora.backend.adapter().tensors
        lora_bytes, lora_s = time_update(dict(tensors), repeats)
    return {"full": {"bytes": full_bytes, "seconds": full_s}, "lora": {"bytes": lora_bytes, "seconds": lora_s,
            "tensors": len(tensors)}, "bytes_ratio": lora_bytes / full_bytes, "time_ratio": lora_s / full_s}


def _learner_child(lora_rank: int, steps: int, out) -> None:
    import torch

    torch.set_num_threads(2)
    rank = make_rank(lora_rank)
    rss_setup = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    tokens = PROMPTS * GROUP * (PROMPT_TOKENS + COMPLETION_TOKENS)
    for k in range(steps):
        t0 = time.perf_counter()
        rank.train_on_shard(k, synthetic_groups(k))
        times.append(time.perf_counter() - t0)
    trainable = sum(p.numel() for p in rank.backend.model.parameters() if p.requires_grad)
    out.put({
        "lora_rank": lora_rank, "trainable_params": trainable,
        "peak_rss_after_setup_bytes": rss_setup,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_seconds": times, "tokens_per_step": tokens,
        "tokens_per_s": tokens / statistics.mean(times[1:] or times),
    })


def bench_learner(lora_rank: int, steps: int) -> dict:
    ctx = mp.get_context("spawn")
    results = {}
    for name, r in (("full", 0), ("lora", lora_rank)):
        q = ctx.Queue()
        p = ctx.Process(target=_learner_child, args=(r, steps, q))
        p.start()
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"learner benchmark ({name}) failed: exit code {p.exitcode}")
        results[name] = q.get(timeout=10)
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--only", choices=["sync", "learner"], default=None)
    args = ap.parse_args()
    out_path = RESULTS / "lora.json"
    result = json.loads(out_path.read_text()) if out_path.exists() else {}
    result["command"] = "python benchmarks/bench_lora.py " + " ".join(sys.argv[1:])
    result["rank"] = args.rank
    if args.only in (None, "sync"):
        result["sync"] = bench_sync(args.rank, args.repeats)
        print(json.dumps(result["sync"], indent=1))
        out_path.write_text(json.dumps(result, indent=1))
    if args.only in (None, "learner"):
        result["learner"] = bench_learner(args.rank, args.steps)
        print(json.dumps(result["learner"], indent=1))
    out_path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
