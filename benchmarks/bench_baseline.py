"""The learning check: a real-model config run N times at HEAD and N times at a reference commit, side by
side, with the held-out curves as ranges. What a learner change is measured against.

    .venv/bin/python benchmarks/bench_baseline.py run --ref c40a23c --seeds 0 1 2     # ~35 min a seed
    .venv/bin/python benchmarks/bench_baseline.py report --name arith_baseline         # tables, JSON, PNG

Both arms run with `train.deterministic` (unless `--free`): a seed's two runs then differ only by
what the commits change, and `report` gives the per-seed differences besides the ranges.

`run` checks the reference commit out into a git worktree (WORKDIR/ref-src, detached) and, for each seed,
launches the config twice at once: this tree (`head-sN`) and the reference (`ref-sN`), each a fresh
`python -m async_rl.launch` process importing its own tree (PYTHONPATH), in this venv. Both runs of a
seed share the machine, so load hits both arms alike. The seed sets the prompt order, vLLM's sampling
and the learner (`data.seed`, `generators.seed`, `train.seed`); the held-out set is the config's.
`--head-only` runs HEAD alone (a new learning check against an old report); `--ref-only` the reference
alone (on a machine where two runs do not fit beside each other).

`report` reads every RUN_DIR/eval.jsonl (greedy held-out pass@1, length, truncation) and metrics.jsonl
(train reward) under WORKDIR, writes benchmarks/results/NAME.{json,png} and prints the tables for NAME.md:
per evaluation step the min-max range and mean of each arm, and each run's curve and train reward.
`--keep-reported` also takes the runs that the last report of NAME kept in NAME.json and whose folders
WORKDIR no longer holds (a run of an earlier day, its /tmp since cleaned), so seeds run on different
days make one report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
ARMS = ("head", "ref")


def ref_tree(args: argparse.Namespace) -> Path:
    """The reference commit checked out (detached) in a worktree of this repository, made once."""
    src = args.workdir / "ref-src"
    if not src.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(src), args.ref], cwd=REPO, check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=src, check=True, capture_output=True, text=True)
    want = subprocess.run(["git", "rev-parse", args.ref], cwd=REPO, check=True, capture_output=True, text=True)
    if head.stdout != want.stdout:
        sys.exit(f"error: {src} holds {head.stdout.strip()[:10]}, not --ref {args.ref}; remove it first")
    return src


def start(tree: Path, name: str, seed: int, args: argparse.Namespace) -> subprocess.Popen:
    """One run of the config in `tree`, started; its console goes to WORKDIR/NAME.log."""
    cmd = [sys.executable, "-m", "async_rl.launch", args.config, f"data.seed={seed}", f"generators.seed={seed}",
           f"train.seed={seed}", f"logging.run_dir={args.workdir}", f"logging.run_name={name}",
           "logging.wandb.mode=disabled", *([] if args.free else ["train.deterministic=true"]), *args.overrides]
    print(f"running ({tree}): {' '.join(cmd[2:])}", flush=True)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with open(args.workdir / f"{name}.log", "w") as log:  # the child keeps its own copy of the file
        return subprocess.Popen(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)


def knows_deterministic(tree: Path) -> bool:
    """The tree's config has train.deterministic (commits before it cannot run a paired comparison)."""
    for path in (tree / "async_rl" / "config" / "train.py", tree / "async_rl" / "config.py"):
        if path.is_file() and "deterministic:" in path.read_text():
            return True
    return False


def run(args: argparse.Namespace) -> None:
    args.workdir.mkdir(parents=True, exist_ok=True)
    trees = {"head": REPO} if args.head_only else {"head": REPO, "ref": ref_tree(args)}
    if args.ref_only:
        trees.pop("head")
    if not args.free:
        for arm, tree in trees.items():
            if not knows_deterministic(tree):
                sys.exit(f"error: the {arm} tree ({tree}) has no train.deterministic: give --free, or a newer --ref")
    for seed in args.seeds:
        procs = {arm: start(tree, f"{arm}-s{seed}", seed, args) for arm, tree in trees.items()}
        for arm, p in procs.items():
            if p.wait() != 0:
                sys.exit(f"error: {arm}-s{seed} exited {p.returncode}; see {args.workdir / f'{arm}-s{seed}.log'}")
    print(f"done: {args.workdir}; now `{Path(__file__).name} report --workdir {args.workdir}`", flush=True)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def runs_of(arm: str, workdir: Path) -> dict[str, dict]:
    """Each finished run of the arm: its evaluations by step and its train rewards."""
    out = {}
    for d in sorted(workdir.glob(f"{arm}-s*")):
        evals, steps = read_jsonl(d / "eval.jsonl"), read_jsonl(d / "metrics.jsonl")
        if d.is_dir() and evals:
            config = (d / "config.yaml").read_text() if (d / "config.yaml").is_file() else ""
            out[d.name] = {"evals": {e["step"]: e for e in evals}, "reward": [s["reward_mean"] for s in steps],
                           "deterministic": "deterministic: true" in config}
    return out


def paired(arms: dict[str, dict[str, dict]], label: dict[str, str]) -> list[str]:
    """Per seed, HEAD's held-out pass@1 minus the reference's at every evaluation both made: with both
    runs deterministic at the same seeds a difference is the change's, not timing's (docs/determinism.md)."""
    head, ref = arms.get("head", {}), arms.get("ref", {})
    seeds = sorted({n.split("-s")[1] for n in head} & {n.split("-s")[1] for n in ref}, key=int)
    if not seeds:
        return []
    lines = ["", f"| seed | deterministic | {label['head']} - {label['ref']}, pass@1 by eval step | at the last |",
             "|---|---|---|---|"]
    for seed in seeds:
        h, r = head[f"head-s{seed}"], ref[f"ref-s{seed}"]
        common = sorted(h["evals"].keys() & r["evals"].keys())
        diffs = [h["evals"][s]["pass_at_1"] - r["evals"][s]["pass_at_1"] for s in common]
        both = "yes" if h.get("deterministic") and r.get("deterministic") else "no"
        curve = " ".join(f"{d:+.3f}" for d in diffs)
        lines.append(f"| {seed} | {both} | {curve} | {diffs[-1]:+.3f} |" if diffs else f"| {seed} | {both} | - | - |")
    return lines


def reported_runs(name: str) -> dict[str, dict[str, dict]]:
    """The runs, by arm, that the last `report --name NAME` kept in benchmarks/results/NAME.json (JSON
    made the evaluation steps strings; they are ints again here)."""
    path = RESULTS / f"{name}.json"
    if not path.is_file():
        return {}
    return {arm: {run: {"evals": {int(s): e for s, e in r["evals"].items()}, "reward": r["reward"]}
                  for run, r in runs.items()}
            for arm, runs in json.loads(path.read_text())["arms"].items()}


def span(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f} ({statistics.fmean(values):.3f})" if values else "-"


def report(args: argparse.Namespace) -> None:
    arms = {arm: runs_of(arm, args.workdir) for arm in ARMS}
    if args.keep_reported:
        for arm, runs in reported_runs(args.name).items():
            for run, kept in runs.items():
                if run not in arms.get(arm, {}):
                    arms.setdefault(arm, {})[run] = kept
                    print(f"{run}: from benchmarks/results/{args.name}.json (not under {args.workdir})")
        arms = {arm: dict(sorted(runs.items())) for arm, runs in arms.items()}
    arms = {arm: runs for arm, runs in arms.items() if runs}
    if not arms:
        sys.exit(f"error: no finished run (eval.jsonl) under {args.workdir}")
    steps = sorted({s for runs in arms.values() for r in runs.values() for s in r["evals"]})
    label = {"head": args.head_label, "ref": args.ref_label}
    lines = [f"| eval step | {' | '.join(f'{label[a]}: pass@1 min-max (mean), n' for a in arms)} |"
             f" {' | '.join(f'{label[a]}: truncated' for a in arms)} |",
             "|---" * (1 + 2 * len(arms)) + "|"]
    for step in steps:
        cells, trunc = [], []
        for runs in arms.values():
            at = [r["evals"][step] for r in runs.values() if step in r["evals"]]
            cells.append(f"{span([e['pass_at_1'] for e in at])}, {len(at)}")
            trunc.append(span([e["truncated_frac"] for e in at]))
        lines.append(f"| {step} | {' | '.join(cells)} | {' | '.join(trunc)} |")
    lines += ["", "| run | pass@1 by eval step | train reward, first 5 steps -> last 5 |", "|---|---|---|"]
    for runs in arms.values():
        for name, r in runs.items():
            curve = " ".join(f"{r['evals'][s]['pass_at_1']:.3f}" for s in sorted(r["evals"]))
            rw = r["reward"]
            first, last = (statistics.fmean(rw[:5]), statistics.fmean(rw[-5:])) if rw else (float("nan"),) * 2
            lines.append(f"| {name} | {curve} | {first:.3f} -> {last:.3f} ({len(rw)} steps) |")
    lines += paired(arms, label)
    table = "\n".join(lines)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"labels": label, "arms": arms}, indent=1))
    plot(arms, label, RESULTS / f"{args.name}.png")
    print(table)


def plot(arms: dict, label: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_eval, ax_reward) = plt.subplots(1, 2, figsize=(11, 4))
    for (arm, runs), color in zip(arms.items(), ("tab:blue", "tab:orange"), strict=False):
        for i, r in enumerate(runs.values()):
            steps = sorted(r["evals"])
            kw = {"color": color, "alpha": 0.8, "label": label[arm] if i == 0 else None}
            ax_eval.plot(steps, [r["evals"][s]["pass_at_1"] for s in steps], marker="o", **kw)
            ax_reward.plot(range(1, len(r["reward"]) + 1), r["reward"], **kw)
    ax_eval.set(xlabel="step", ylabel="held-out pass@1 (greedy)", title="held-out evaluation, each run")
    ax_reward.set(xlabel="step", ylabel="batch reward (sampled)", title="train reward, each run")
    ax_eval.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("run", "report"))
    p.add_argument("--config", default="configs/smollm2_arith.yaml")
    p.add_argument("--ref", default="c40a23c", help="the reference commit")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    arms = p.add_mutually_exclusive_group()
    arms.add_argument("--head-only", action="store_true", help="run this tree only")
    arms.add_argument("--ref-only", action="store_true",
                      help="run the reference alone (one run at a time on a machine where two do not fit)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/bench_baseline"))
    p.add_argument("--name", default="arith_baseline", help="report: benchmarks/results/NAME.*")
    p.add_argument("--keep-reported", action="store_true",
                   help="report: also the runs NAME.json kept whose folders WORKDIR no longer holds")
    p.add_argument("--free", action="store_true",
                   help="run: free-running runs (not train.deterministic): needed for a reference that predates it")
    p.add_argument("--head-label", default="HEAD")
    p.add_argument("--ref-label", default="reference")
    p.add_argument("overrides", nargs="*", help="config overrides for every run (key=value)")
    args = p.parse_intermixed_args()  # overrides may follow the options
    run(args) if args.command == "run" else report(args)


if __name__ == "__main__":
    main()
