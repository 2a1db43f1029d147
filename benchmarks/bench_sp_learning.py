"""Does sequence parallelism learn as one rank does? The quickstart task (tiny-qwen2 learns 'repeat')
at learner.sequence_parallel_size 1 and 2, N seeds each, one run at a time.

    .venv/bin/python benchmarks/bench_sp_learning.py run --seeds 0 1 2      # ~4 min a run on 2 cores
    .venv/bin/python benchmarks/bench_sp_learning.py report                 # benchmarks/results/sp_quickstart.*

SP = 1 is one learner rank; SP = 2 is two ranks in one SP group (DP = 1): every sequence split by
position between them, attention's heads exchanged with all-to-all (docs/sequence-parallel.md). The
seed sets the prompt stream, vLLM's sampling and the learner (`data.seed`, `generators.seed`,
`train.seed`). Generation is asynchronous and not bit-reproducible across runs, so the two arms of a
seed are two samples of learning, not one computation twice: the claim is about ranges over seeds.
Each step's `logprob_mismatch` (the learner's log-probs against vLLM's on the same tokens and weights)
is the check that SP's log-probs are the model's.
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
SPS = (1, 2)


def run(args: argparse.Namespace) -> None:
    args.workdir.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        for sp in SPS:
            name = f"sp{sp}-s{seed}"
            cmd = [sys.executable, "-m", "async_rl.launch", "configs/quickstart.yaml",
                   f"train.total_steps={args.steps}", f"learner.world_size={sp}", f"learner.sequence_parallel_size={sp}",
                   f"data.seed={seed}", f"generators.seed={seed}", f"train.seed={seed}",
                   f"logging.run_dir={args.workdir}", f"logging.run_name={name}", "logging.wandb.mode=disabled"]
            print("running:", " ".join(cmd[2:]), flush=True)
            with open(args.workdir / f"{name}.log", "w") as log:
                rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                sys.exit(f"error: {name} exited {rc}; see {args.workdir / f'{name}.log'}")
    print(f"done: {args.workdir}; now `{Path(__file__).name} report --workdir {args.workdir}`", flush=True)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def runs_of(sp: int, workdir: Path) -> dict[str, list[dict]]:
    """Each run of the arm that logged steps: its metrics.jsonl records."""
    return {d.name: recs for d in sorted(workdir.glob(f"sp{sp}-s*")) if d.is_dir() and (recs := read_jsonl(d / "metrics.jsonl"))}


def span(values: list[float], fmt: str = ".3f") -> str:
    return f"{min(values):{fmt}}-{max(values):{fmt}}" if values else "-"


def report(args: argparse.Namespace) -> None:
    arms = {sp: runs_of(sp, args.workdir) for sp in SPS}
    if not all(arms.values()):
        sys.exit(f"error: a finished run of each of SP={SPS} is needed under {args.workdir}")
    steps = min(len(recs) for runs in arms.values() for recs in runs.values())
    head = ["step", *(f"reward SP={sp} (min-max, n={len(arms[sp])})" for sp in SPS),
            *(f"mismatch SP={sp}" for sp in SPS)]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for i in range(steps):
        rewards = [span([recs[i]["reward_mean"] for recs in arms[sp].values()]) for sp in SPS]
        mismatch = [span([recs[i]["logprob_mismatch"] for recs in arms[sp].values()], ".1e") for sp in SPS]
        lines.append(f"| {i} | " + " | ".join(rewards + mismatch) + " |")
    lines += ["", "| run | reward, first 5 steps -> last 5 | largest mismatch | learner compute s a step (mean) |", "|---|---|---|---|"]
    for runs in arms.values():
        for name, recs in runs.items():
            rw = [r["reward_mean"] for r in recs]
            lines.append(f"| {name} | {statistics.fmean(rw[:5]):.3f} -> {statistics.fmean(rw[-5:]):.3f} | "
                         f"{max(r['logprob_mismatch'] for r in recs):.1e} | "
                         f"{statistics.fmean(r['learner_compute_s'] for r in recs):.2f} |")
    last5 = {sp: [statistics.fmean(r["reward_mean"] for r in recs[-5:]) for recs in arms[sp].values()] for sp in SPS}
    lines += ["", "Reward of the last 5 steps, range over runs: "
              + "; ".join(f"SP={sp} {span(v)} (mean {statistics.fmean(v):.3f})" for sp, v in last5.items())]
    table = "\n".join(lines)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps({str(sp): runs for sp, runs in arms.items()}, indent=1))
    plot(arms, RESULTS / f"{args.name}.png")
    print(table)


def plot(arms: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (sp, runs), color in zip(arms.items(), ("tab:blue", "tab:orange"), strict=True):
        for i, recs in enumerate(runs.values()):
            ax.plot([r["step"] for r in recs], [r["reward_mean"] for r in recs], color=color, alpha=0.8,
                    label=f"SP={sp}" if i == 0 else None)
    ax.set(xlabel="step", ylabel="batch reward (sampled)", title="quickstart task, each run")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("run", "report"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--workdir", type=Path, default=REPO / "runs" / "sp_learning")
    p.add_argument("--name", default="sp_quickstart", help="benchmarks/results/NAME.{json,png}")
    args = p.parse_args()
    run(args) if args.command == "run" else report(args)


if __name__ == "__main__":
    main()
