"""What train.deterministic costs: the same config run free and deterministic, alternating, one run
at a time, and the training time of each compared (start-up excluded: from the first step's start to
the last step's end, `elapsed_s` of the last metrics record).

    .venv/bin/python benchmarks/bench_determinism.py --config configs/quickstart.yaml --pairs 3 \\
        --name determinism_cost_quickstart train.total_steps=40

Writes benchmarks/results/NAME.json: every run's training seconds, steps per second, the time its
syncs waited for the engines to finish their version (`settle_s`, deterministic only) and the
learner's wait for batches; per arm the medians; and the ratio deterministic / free of the median
training time. Run it with nothing else on the machine: both arms then meet the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
ARMS = {"free": "train.deterministic=false", "deterministic": "train.deterministic=true"}


def one_run(config: str, arm: str, name: str, workdir: Path, overrides: list[str]) -> dict:
    cmd = [sys.executable, "-m", "async_rl.launch", config, ARMS[arm], f"logging.run_dir={workdir}",
           f"logging.run_name={name}", "logging.wandb.mode=disabled", *overrides]
    print(f"{name}: {' '.join(cmd[2:])}", flush=True)
    t0 = time.perf_counter()
    with open(workdir / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0:
        sys.exit(f"error: {name} exited {rc}; see {workdir / f'{name}.log'}")
    records = [json.loads(line) for line in (workdir / name / "metrics.jsonl").read_text().splitlines()]
    train_s = records[-1]["elapsed_s"]
    out = {
        "arm": arm,
        "run": name,
        "wall_s": round(time.perf_counter() - t0, 1),
        "train_s": round(train_s, 2),
        "steps": len(records),
        "steps_per_s": round(len(records) / train_s, 3),
        "settle_s": round(sum(r.get("settle_s", 0.0) for r in records), 2),
        "sync_s": round(sum(r["sync_s"] for r in records), 2),
        "learner_wait_s": round(sum(r["learner_wait_s"] for r in records), 2),
        "reward_last": records[-1]["reward_mean"],
    }
    print(f"  {json.dumps(out)}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--pairs", type=int, default=3, help="runs per arm, alternating free and deterministic")
    ap.add_argument("--name", required=True, help="benchmarks/results/NAME.json")
    ap.add_argument("overrides", nargs="*", help="section.key=value for both arms")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]  # the 1-minute load when the benchmark began
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-determinism-") as tmp:
        for i in range(args.pairs):
            order = ("free", "deterministic") if i % 2 == 0 else ("deterministic", "free")
            for arm in order:
                runs.append(one_run(args.config, arm, f"{arm}-{i}", Path(tmp), args.overrides))
    arms = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        arms[arm] = {k: statistics.median(r[k] for r in mine) for k in ("train_s", "steps_per_s", "settle_s", "learner_wait_s")}
    ratio = arms["deterministic"]["train_s"] / arms["free"]["train_s"]
    result = {
        "command": " ".join(["benchmarks/bench_determinism.py", *sys.argv[1:]]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
        "load_before": load_before,
        "runs": runs,
        "median": arms,
        "deterministic_over_free_train_s": round(ratio, 3),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"deterministic / free training time (medians): {ratio:.3f}; wrote {RESULTS / args.name}.json")


if __name__ == "__main__":
    main()
