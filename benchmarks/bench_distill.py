"""Learning from a teacher on the arithmetic task: on-policy distillation against RL alone,
and SFT-then-RL against RL alone, at the same RL sample budget. Every run is a fresh
`python -m async_rl.launch` process; held-out pass@1 comes from each run's RUN_DIR/eval.jsonl (greedy,
the 96 questions of configs/data/arith_eval.jsonl), the reverse KL to the teacher from metrics.jsonl.

    .venv/bin/python benchmarks/bench_distill.py teacher                  # 1. the teacher (RL recipe, kept)
    .venv/bin/python benchmarks/bench_distill.py opd --teacher DIR        # 2. student distilled from it
    .venv/bin/python benchmarks/bench_distill.py rl                       # 3. RL alone, same samples
    .venv/bin/python benchmarks/bench_distill.py sft-rl                   # 4. SFT warm-up, then RL from it
    .venv/bin/python benchmarks/bench_distill.py report                   # curves side by side
    .venv/bin/python benchmarks/bench_distill.py all [--repeats 3]        # 1-5 in order
    .venv/bin/python benchmarks/bench_distill.py all --quick              # 2 small steps per run: checks the script

1. `teacher`: configs/smollm2_arith.yaml with a final checkpoint; the teacher is that checkpoint's
   model/ folder (an HF folder with SmolLM2's tokenizer; its held-out pass@1 is the run's last eval).
2. `opd`: configs/smollm2_arith_opd.yaml (the student SmolLM2-135M-Instruct, algorithm.name=opd) with
   teacher.model=DIR (default: the teacher run's checkpoint under --workdir).
3. `rl`: configs/smollm2_arith.yaml again (the comparison arm; its own seed).
4. `sft-rl`: configs/smollm2_arith_sft.yaml (--sft-steps x 16 demonstrations), then
   configs/smollm2_arith.yaml from its last checkpoint's model/ folder.
5. `report`: benchmarks/results/distill.md (tables), distill.json (every curve), distill.png
   (`--quick`: distill-quick.*).

Each arm runs --steps RL steps of 8 prompts x 6 samples (the config's). --repeats N runs each of
opd, rl and sft-rl N times (seeds train.seed=0..N-1) and reports the range.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
ARMS = ("opd", "rl", "sft-rl")


def launch(config: str, name: str, args: argparse.Namespace, overrides: list[str]) -> Path:
    """One run, to completion; its run directory."""
    cmd = [sys.executable, "-m", "async_rl.launch", config, f"logging.run_dir={args.workdir}", f"logging.run_name={name}",
           "logging.wandb.mode=disabled", *quick_overrides(config, args), *overrides]
    print("running:", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)
    return args.workdir / name


def quick_overrides(config: str, args: argparse.Namespace) -> list[str]:
    """--quick: 2 steps of 2 prompts x 2 samples (SFT: 2 steps of 4), evaluations at the start and the end
    only: checks the script end to end, not learning (the tiny presets have no chat template)."""
    if not args.quick:
        return []
    if "sft" in config:
        return ["sft.batch_size=4", "sft.eval_every=0"]
    return ["generators.group_size=2", "train.prompts_per_step=2", "eval.every=0"]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def teacher_dir(args: argparse.Namespace) -> Path:
    ck = args.workdir / "teacher" / "checkpoints" / f"step_{args.steps}" / "model"
    return Path(args.teacher) if args.teacher else ck


def run_teacher(args: argparse.Namespace) -> None:
    launch("configs/smollm2_arith.yaml", "teacher", args, [f"train.total_steps={args.steps}", "train.checkpoint_at_end=true"])
    print(f"teacher: {teacher_dir(args)}", flush=True)


def run_arm(arm: str, seed: int, args: argparse.Namespace) -> None:
    # the seed sets the prompt order, vLLM's sampling and the learner, as bench_baseline.py's runs do: an
    # `rl` arm of seed s is that script's head-sS run (same config and overrides)
    steps = [f"train.total_steps={args.steps}", f"data.seed={seed}", f"train.seed={seed}", f"generators.seed={seed}"]
    if arm == "opd":
        teacher = str(teacher_dir(args)) if args.teacher or not args.quick else "smollm2-135m"  # quick: KL 0
        launch("configs/smollm2_arith_opd.yaml", f"opd-{seed}", args, [*steps, f"teacher.model={teacher}"])
    elif arm == "rl":
        launch("configs/smollm2_arith.yaml", f"rl-{seed}", args, steps)
    else:
        sft_steps = 2 if args.quick else args.sft_steps
        sft = launch("configs/smollm2_arith_sft.yaml", f"sft-{seed}", args, [f"train.seed={seed}", f"train.total_steps={sft_steps}"])
        model = sft / "checkpoints" / f"step_{sft_steps}" / "model"
        launch("configs/smollm2_arith.yaml", f"sft-rl-{seed}", args, [*steps, f"model.path={model}"])


def curve(run_dir: Path) -> dict:
    """A run's held-out pass@1 per evaluation, and its per-step train reward, KL to the teacher, samples."""
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    return {
        "eval": [{"step": e["step"], "pass_at_1": e["pass_at_1"], "len": e["completion_len_mean"]}
                 for e in read_jsonl(run_dir / "eval.jsonl")],
        "steps": [{"step": r["step"], "trained": r["trained"], "reward": r["reward_mean"], "kl_teacher": r.get("kl_teacher", 0.0),
                   "teacher_share": r.get("teacher_share", 0.0), "teacher_tokens_per_s": r.get("teacher_tokens_per_s", 0.0)}
                  for r in metrics],
    }


def report(args: argparse.Namespace) -> None:
    runs = {arm: {} for arm in ARMS}
    for arm in ARMS:
        for seed in range(args.repeats):
            d = args.workdir / f"{arm}-{seed}"
            if d.is_dir():
                runs[arm][seed] = curve(d)
    teacher = curve(args.workdir / "teacher") if (args.workdir / "teacher").is_dir() else None
    sft = {seed: read_jsonl(args.workdir / f"sft-{seed}" / "eval.jsonl") for seed in range(args.repeats)}
    out = {"teacher": teacher, "runs": runs, "sft_eval_loss": sft, "steps": args.steps}
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "distill-quick" if args.quick else "distill"  # a check never overwrites the real results
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=1))
    lines = ["# Learning from a teacher: OPD vs RL, SFT-then-RL vs RL (benchmarks/bench_distill.py)", "",
             f"Workdir {args.workdir}; {args.repeats} run(s) per arm; held-out pass@1 (greedy), range over runs.", ""]
    if teacher and teacher["eval"]:
        lines += [f"Teacher (RL recipe, {args.steps} steps): pass@1 {teacher['eval'][0]['pass_at_1']:.3f} -> "
                  f"{teacher['eval'][-1]['pass_at_1']:.3f}", ""]
    evals = sorted({e["step"] for arm in runs.values() for c in arm.values() for e in c["eval"]})
    lines += ["| step | " + " | ".join(ARMS) + " |", "|---" * (len(ARMS) + 1) + "|"]
    for step in evals:
        cells = []
        for arm in ARMS:
            vals = [e["pass_at_1"] for c in runs[arm].values() for e in c["eval"] if e["step"] == step]
            cells.append(f"{min(vals):.3f}-{max(vals):.3f}" if len(vals) > 1 else (f"{vals[0]:.3f}" if vals else ""))
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    kls = [[s["kl_teacher"] for s in c["steps"]] for c in runs["opd"].values()]
    if kls:
        lines += ["", "OPD mean reverse KL to the teacher per step (first run): "
                  + ", ".join(f"{x:.3f}" for x in kls[0])]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(runs, RESULTS / f"{name}.png")


def plot(runs: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for color, arm in zip(("C0", "C1", "C2"), ARMS, strict=True):
        for i, c in enumerate(runs[arm].values()):
            xs = [e["step"] for e in c["eval"]]
            ax.plot(xs, [e["pass_at_1"] for e in c["eval"]], color=color, marker="o", label=arm if i == 0 else None)
    ax.set_xlabel("RL step (8 prompts x 6 samples)")
    ax.set_ylabel("held-out pass@1 (greedy)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("teacher", *ARMS, "report", "all"))
    ap.add_argument("--steps", type=int, default=20, help="RL steps of every arm (and of the teacher)")
    ap.add_argument("--sft-steps", type=int, default=30, help="SFT steps before sft-rl's RL")
    ap.add_argument("--repeats", type=int, default=1, help="runs per arm: seeds 0..N-1")
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="run these seeds of the arm instead of 0..repeats-1 (one run at a time on a small machine)")
    ap.add_argument("--teacher", default="", help="the teacher's HF folder (default: the teacher run's checkpoint)")
    ap.add_argument("--workdir", type=Path, default=REPO / "runs" / "distill")
    ap.add_argument("--quick", action="store_true", help="2 small steps per run: checks the script, not learning")
    args = ap.parse_args()
    if args.quick:
        args.steps = 2
    if args.what in ("teacher", "all") and not args.quick:
        run_teacher(args)
    for arm in ARMS:
        if args.what in (arm, "all"):
            for seed in args.seeds or range(args.repeats):
                run_arm(arm, seed, args)
    if args.what in ("report", "all"):
        report(args)


if __name__ == "__main__":
    main()
