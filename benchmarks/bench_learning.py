"""Learning: asynchronous (max_lag 2) against synchronous (max_lag 0) training on the quickstart task.

Same config, seeds and number of samples (steps x batch) on each side; each run is a fresh
`python -m async_rl.launch configs/quickstart.yaml` process. Writes the reward curves as JSONL and one
PNG under benchmarks/results/, and prints the final rewards (mean of the last --final-steps steps),
their ratio, and the vLLM-vs-learner log-prob mismatch measured after every weight sync.

    .venv/bin/python benchmarks/bench_learning.py [--steps 100] [--lags 0 2] [--final-steps 10]
    .venv/bin/python benchmarks/bench_learning.py --quick      # 20 steps: checks the script, not learning
    .venv/bin/python benchmarks/bench_learning.py --replot     # summary and PNG again from the curves JSONL
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
CURVE_FIELDS = (
    "step",
    "trained",
    "elapsed_s",
    "reward_mean",
    "lag_mean",
    "lag_max",
    "logprob_mismatch",
    "logprob_abs_diff",
    "kl_behav",
    "clip_frac",
)


def run(max_lag: int, steps: int, workdir: Path, overrides: list[str]) -> list[dict]:
    name = f"lag{max_lag}"
    cmd = [
        sys.executable,
        "-m",
        "async_rl.launch",
        str(REPO / "configs" / "quickstart.yaml"),
        f"train.max_lag={max_lag}",
        f"train.total_steps={steps}",
        f"logging.run_dir={workdir}",
        f"logging.run_name={name}",
        "logging.wandb.mode=disabled",
        *overrides,
    ]
    print(f"running max_lag={max_lag}: {' '.join(cmd[2:])}", flush=True)
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (workdir / name / "metrics.jsonl").read_text().splitlines()]
    return [{"max_lag": max_lag, **{k: r[k] for k in CURVE_FIELDS}} for r in records]


def samples_to(curve: list[dict], level: float, window: int) -> int | None:
    """Samples trained when the `window`-step mean reward first reaches `level` (None: never)."""
    for i in range(window - 1, len(curve)):
        if statistics.mean(r["reward_mean"] for r in curve[i - window + 1 : i + 1]) >= level:
            return curve[i]["trained"]
    return None


def summarize(curve: list[dict], final_steps: int) -> dict:
    mismatch = [r["logprob_mismatch"] for r in curve if r["logprob_mismatch"] is not None]
    return {
        "max_lag": curve[0]["max_lag"],
        "steps": len(curve),
        "samples": curve[-1]["trained"],
        "first_reward": statistics.mean(r["reward_mean"] for r in curve[:final_steps]),
        "final_reward": statistics.mean(r["reward_mean"] for r in curve[-final_steps:]),
        "samples_to_0.9": samples_to(curve, 0.9, final_steps),
        "lag_mean": statistics.mean(r["lag_mean"] for r in curve),
        "wall_s": curve[-1]["elapsed_s"],
        "mismatch_mean": statistics.mean(mismatch) if mismatch else None,
        "mismatch_max": max(mismatch) if mismatch else None,
    }


def plot(curves: dict[int, list[dict]], path: Path, smooth: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for lag, curve in curves.items():
        x = [r["trained"] for r in curve]
        y = [r["reward_mean"] for r in curve]
        ys = [statistics.mean(y[max(0, i - smooth + 1) : i + 1]) for i in range(len(y))]
        line = ax.plot(x, ys, label=f"max_lag {lag}" + (" (sync)" if lag == 0 else " (async)"))[0]
        ax.plot(x, y, color=line.get_color(), alpha=0.25, linewidth=0.8)
    ax.set_xlabel("samples trained")
    ax.set_ylabel(f"batch mean reward ({smooth}-step mean; faint: per step)")
    ax.set_title("quickstart 'repeat' task: asynchronous vs synchronous")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lags", type=int, nargs="+", default=[0, 2], help="the first is the baseline")
    ap.add_argument("--final-steps", type=int, default=10, help="steps averaged for the final reward")
    ap.add_argument("--quick", action="store_true", help="20 steps, final reward over 5: checks the script")
    ap.add_argument("--tag", default="learning", help="results file name stem")
    ap.add_argument(
        "--replot", action="store_true", help="no runs: summary and PNG from the tag's curves JSONL"
    )
    ap.add_argument("overrides", nargs="*", help="extra section.key=value config overrides for every run")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.final_steps, args.tag = 20, 5, args.tag + "_quick"
    jsonl = RESULTS / f"{args.tag}_curves.jsonl"
    curves: dict[int, list[dict]] = {}
    if args.replot:
        for line in jsonl.read_text().splitlines():
            r = json.loads(line)
            curves.setdefault(r["max_lag"], []).append(r)
        args.lags = list(curves)
        args.steps = len(curves[args.lags[0]])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for lag in args.lags:
                curves[lag] = run(lag, args.steps, Path(tmp), args.overrides)
    rows = [summarize(c, args.final_steps) for c in curves.values()]
    base = rows[0]["final_reward"]
    for r in rows:
        r["final_vs_baseline"] = r["final_reward"] / base if base else None
    RESULTS.mkdir(parents=True, exist_ok=True)
    if not args.replot:
        with jsonl.open("w") as f:
            for c in curves.values():
                for r in c:
                    f.write(json.dumps(r) + "\n")
    png = RESULTS / f"{args.tag}.png"
    plot(curves, png, smooth=max(1, args.final_steps // 2))
    summary = RESULTS / f"{args.tag}.json"
    summary.write_text(
        json.dumps(
            {"steps": args.steps, "final_steps": args.final_steps, "overrides": args.overrides, "rows": rows},
            indent=2,
        )
    )
    print(
        f"\n{'max_lag':>7} {'samples':>8} {'first':>7} {'final':>7} {'vs lag ' + str(args.lags[0]):>10} "
        f"{'to 0.9':>8} {'mean lag':>9} {'wall s':>7} {'mismatch mean/max':>20}"
    )
    for r in rows:
        mm = f"{r['mismatch_mean']:.1e}/{r['mismatch_max']:.1e}" if r["mismatch_mean"] is not None else "n/a"
        ratio = f"{r['final_vs_baseline']:.3f}" if r["final_vs_baseline"] is not None else "n/a"
        reach = str(r["samples_to_0.9"]) if r["samples_to_0.9"] is not None else "never"
        print(
            f"{r['max_lag']:>7} {r['samples']:>8} {r['first_reward']:7.3f} {r['final_reward']:7.3f} {ratio:>10} "
            f"{reach:>8} {r['lag_mean']:9.2f} {r['wall_s']:7.0f} {mm:>20}"
        )
    for r in rows[1:]:
        if r["final_vs_baseline"] is not None:
            within = abs(r["final_vs_baseline"] - 1) <= 0.05
            print(
                f"max_lag {r['max_lag']} final reward is {r['final_vs_baseline']:.1%} of max_lag {args.lags[0]}'s "
                f"({'within' if within else 'NOT within'} 5%)"
            )
    print(f"\nwrote {jsonl}\nwrote {png}\nwrote {summary}")


if __name__ == "__main__":
    main()
