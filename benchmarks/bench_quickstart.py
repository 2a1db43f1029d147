"""Quickstart throughput: synchronous (max_lag 0) against asynchronous (max_lag 1, 2) training.

Same model, task, batch and number of steps on each side; each run is a fresh
`python -m async_rl.launch` process. Samples/s counts steady-state steps only (from the end of
step 1 to the end of the last step), so engine start-up is excluded on both sides.

    .venv/bin/python benchmarks/bench_quickstart.py [--steps 40] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def run_once(max_lag: int, steps: int, workdir: Path) -> dict:
    run_dir = workdir / f"lag{max_lag}-{time.time_ns()}"
    cmd = [
        sys.executable, "-m", "async_rl.launch", str(REPO / "configs" / "quickstart.yaml"),
        f"train.max_lag={max_lag}", f"train.total_steps={steps}",
        f"logging.run_dir={run_dir.parent}", f"logging.run_name={run_dir.name}", "logging.wandb.mode=disabled",
    ]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = records[-1]["elapsed_s"] - records[0]["elapsed_s"]
    samples = records[-1]["trained"] - records[0]["trained"]
    return {
        "max_lag": max_lag,
        "samples_per_s": samples / steady,
        "learner_wait_frac": sum(r["learner_wait_s"] for r in records[1:]) / steady,
        "final_reward": statistics.mean(r["reward_mean"] for r in records[-5:]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for max_lag in (0, 1, 2):
            runs = [run_once(max_lag, args.steps, Path(tmp)) for _ in range(args.repeats)]
            sps = [r["samples_per_s"] for r in runs]
            rows.append({
                "max_lag": max_lag,
                "samples_per_s_min": min(sps),
                "samples_per_s_median": statistics.median(sps),
                "samples_per_s_max": max(sps),
                "learner_wait_frac": statistics.median(r["learner_wait_frac"] for r in runs),
                "final_reward": statistics.median(r["final_reward"] for r in runs),
            })
            print(f"max_lag {max_lag}: {rows[-1]}", flush=True)
    base = rows[0]["samples_per_s_median"]
    print(f"\n{'max_lag':>7} {'samples/s (min/med/max)':>26} {'vs sync':>8} {'learner wait':>13} {'final reward':>13}")
    for r in rows:
        print(
            f"{r['max_lag']:>7} {r['samples_per_s_min']:8.1f}/{r['samples_per_s_median']:7.1f}/{r['samples_per_s_max']:7.1f}"
            f" {r['samples_per_s_median'] / base:7.2f}x {r['learner_wait_frac']:12.0%} {r['final_reward']:13.3f}"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "quickstart.json"
    out.write_text(json.dumps({"steps": args.steps, "repeats": args.repeats, "rows": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
