"""Stability of the quickstart past convergence: N seeds x 300 steps of configs/quickstart.yaml, each
judged by its mean reward over the last 50 steps (the bar: >= 0.95 in every seed).

Runs each seed as `python -m async_rl.launch configs/quickstart.yaml train.total_steps=STEPS
train.seed=S generators.seed=S task.seed=S` (one after the other; on the shared 2-core machine wrap
the script alone on a quiet machine), or, with --runs, only reads finished runs' metrics.jsonl. Writes
benchmarks/results/stability.json (per-step reward, KL to behaviour, grad norm, entropy per seed)
and stability.png.

    .venv/bin/python benchmarks/bench_stability.py [--seeds 1 2 3 4 5] [--steps 300]
    .venv/bin/python benchmarks/bench_stability.py --runs RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
LAST = 50
BAR = 0.95
FIELDS = ("reward_mean", "kl_behav", "grad_norm", "entropy", "clip_frac")


def run_seed(seed: int, steps: int, run_root: Path) -> Path:
    before = set(run_root.glob("*")) if run_root.exists() else set()
    cmd = [
        sys.executable, "-m", "async_rl.launch", "configs/quickstart.yaml", f"train.total_steps={steps}",
        f"train.seed={seed}", f"generators.seed={seed}", f"task.seed={seed}", f"logging.run_dir={run_root}",
        "logging.wandb.mode=disabled",
    ]
    subprocess.run(cmd, cwd=REPO, check=True)
    (new,) = set(run_root.glob("*")) - before
    return new


def summarize(run_dirs: dict[int, Path]) -> dict:
    seeds = {}
    for seed, d in run_dirs.items():
        records = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line]
        curves = {f: [r.get(f, 0.0) for r in records] for f in FIELDS}
        seeds[str(seed)] = {
            "run_dir": str(d),
            "steps": len(records),
            "last50_reward": statistics.mean(curves["reward_mean"][-LAST:]),
            "max_kl_behav_after_50": max(curves["kl_behav"][50:], default=0.0),
            "zero_gradient_steps": sum(1 for g in curves["grad_norm"] if g == 0.0),
            **curves,
        }
    return {"bar": BAR, "last": LAST, "seeds": seeds, "passed": all(s["last50_reward"] >= BAR for s in seeds.values())}


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, kl) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for seed, s in data["seeds"].items():
        ax.plot(s["reward_mean"], lw=0.8, label=f"seed {seed}: last {LAST} {s['last50_reward']:.3f}")
        kl.plot(s["kl_behav"], lw=0.8)
    ax.axhline(BAR, color="k", ls="--", lw=0.6)
    ax.set_ylabel("mean reward")
    ax.legend(fontsize=8, loc="lower right")
    kl.set_ylabel("KL(behaviour || learner)")
    kl.set_xlabel("step")
    ax.set_title("quickstart (repeat, tiny-qwen2, grpo, lr 2e-3, max_lag 1): 300 steps per seed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--run-root", type=Path, default=REPO / "runs" / "stability")
    ap.add_argument("--runs", type=Path, nargs="*", help="finished run folders (seed read from their config)")
    ap.add_argument("--name", default="stability")
    args = ap.parse_args()
    if args.runs:
        import yaml

        run_dirs = {int(yaml.safe_load((d / "config.yaml").read_text())["train"]["seed"]): d for d in args.runs}
    else:
        run_dirs = {s: run_seed(s, args.steps, args.run_root) for s in args.seeds}
    data = summarize(run_dirs)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(data))
    plot(data, RESULTS / f"{args.name}.png")
    for seed, s in data["seeds"].items():
        print(f"seed {seed}: last {LAST} mean reward {s['last50_reward']:.3f}, max KL to behaviour after step 50 "
              f"{s['max_kl_behav_after_50']:.3f}, steps without gradient {s['zero_gradient_steps']}")
    print("passed" if data["passed"] else "FAILED", f"(bar {BAR} over the last {LAST} steps in every seed)")


if __name__ == "__main__":
    main()
