"""Summarise a real-model run (configs/smollm2_arith.yaml, configs/smollm2_tools.yaml): eval pass@1
before/after, the curves, the command.

    python benchmarks/report_run.py RUN_DIR --name smollm2_arith --command "..." [--load "..."]

Reads RUN_DIR/metrics.jsonl (one record per training step) and RUN_DIR/eval.jsonl (one record per
evaluation) and writes benchmarks/results/NAME.{json,png}: eval pass@1 (overall and per data source)
and train reward against step and wall time; for multi-turn runs (env) also tool calls, tool errors
and tool-call success per episode. Prints the markdown table for NAME.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


TOOL_KEYS = ("turns_mean", "tool_calls_per_episode", "tool_errors_per_episode", "tool_success")
# The policy's mean per-token entropy and what the entropy controls did (docs/algorithms.md#entropy-controls).
ENTROPY_KEYS = ("entropy", "cov_frac", "clip_frac")
# An MoE run's routing per step (docs/moe.md): the live router's agreement with the engine's routes, and the
# probe's log-prob mismatch with replay and with the live router.
MOE_FORMATS = {"lag_max": "d", "router_agreement": ".1%", "router_agreement_worst_layer": ".1%",
               "moe_mismatch_replay": ".1e", "moe_mismatch_live": ".1e", "logprob_mismatch": ".1e",
               "clip_frac": ".3f", "expert_load_max_mean": ".2f", "moe_unrouted_tokens": "d"}
MOE_KEYS = tuple(MOE_FORMATS)


def is_multi_turn(steps: list[dict]) -> bool:
    return any(r.get("turns_max", 0) for r in steps)


def is_moe(steps: list[dict]) -> bool:
    return any(r.get("moe_replay") is not None for r in steps)


def moe_table(steps: list[dict]) -> str:
    """Per step: the lag, the router agreement (every layer; worst layer), the probe's mismatch with replay
    and live, the batch's mismatch after the sync, the clip fraction, the expert load, the unrouted tokens."""
    def cell(r: dict, key: str) -> str:
        return "-" if r.get(key) is None else format(r[key], MOE_FORMATS[key])

    head = "| step | " + " | ".join(MOE_KEYS) + " |\n|---|" + "---|" * len(MOE_KEYS)
    return head + "".join(f"\n| {r['step'] + 1} | " + " | ".join(cell(r, k) for k in MOE_KEYS) + " |" for r in steps)


def plot(steps: list[dict], evals: list[dict], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tools = is_multi_turn(steps)
    panels = 3 if tools else 2
    fig, axes = plt.subplots(1, panels + 1, figsize=(6 * (panels + 1), 4.5))
    sources = sorted({s for e in evals for s in e["per_source"]})
    for ax, key, label in ((axes[0], "step", "optimizer step"), (axes[1], "elapsed_s", "wall time since training started (s)")):
        # train record `step` is the step index (policy version step+1 after it); eval `step` = steps done
        tx = [r["step"] + 1 if key == "step" else r["elapsed_s"] for r in steps]
        ex = [e["step"] if key == "step" else e["elapsed_s"] for e in evals]
        ax.plot(tx, [r["reward_mean"] for r in steps], color="0.6", lw=1, label="train reward (batch mean, sampled at generators.temperature)")
        ax.plot(ex, [e["pass_at_1"] for e in evals], "o-", color="C3", lw=2, label="eval pass@1 (greedy, held out)")
        for i, src in enumerate(sources):
            ax.plot(ex, [e["per_source"][src]["pass_at_1"] for e in evals], ".--", color=f"C{i}", lw=1, label=f"eval pass@1 {src}")
        ax.set_xlabel(label)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy / reward")
    axes[0].legend(fontsize=8, loc="upper left")
    if tools:
        ax = axes[2]
        x = [r["step"] + 1 for r in steps]
        for key in TOOL_KEYS:
            if any(key in r for r in steps):
                ax.plot(x, [r.get(key, float("nan")) for r in steps], "o-", lw=1.5, label=key)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("per episode of the trained batch")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[-1]
    x = [r["step"] + 1 for r in steps]
    for key in ENTROPY_KEYS:
        if any(r.get(key) for r in steps):
            ax.plot(x, [r.get(key, float("nan")) for r in steps], "o-", lw=1.5, label=key)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("trained batch: entropy per token (nats), token fractions")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--name", required=True, help="results file stem, e.g. smollm2_arith")
    ap.add_argument("--title", default="", help="figure title (default: the name)")
    ap.add_argument("--command", required=True, help="the exact command that made the run")
    ap.add_argument("--load", default="", help="load average the run ran under")
    args = ap.parse_args()
    steps = read_jsonl(args.run_dir / "metrics.jsonl")
    evals = read_jsonl(args.run_dir / "eval.jsonl")
    first, last = evals[0], evals[-1]
    best = max(evals, key=lambda e: e["pass_at_1"])
    summary = {
        "command": args.command,
        "load_average": args.load,
        "steps": len(steps),
        "train_wall_s": steps[-1]["elapsed_s"] if steps else 0.0,
        "eval_before": {"step": first["step"], "pass_at_1": first["pass_at_1"], "per_source": first["per_source"]},
        "eval_after": {"step": last["step"], "pass_at_1": last["pass_at_1"], "per_source": last["per_source"]},
        "eval_best": {"step": best["step"], "pass_at_1": best["pass_at_1"]},
        "evals": [
            {k: e[k] for k in ("step", "elapsed_s", "eval_s", "pass_at_1", "reward", "completion_len_mean", "truncated_frac")}
            for e in evals
        ],
        "train": [
            {
                k: r.get(k)
                for k in ("step", "elapsed_s", "reward_mean", "completion_len_mean", "truncation_rate", "logprob_mismatch")
                + ENTROPY_KEYS
                + (TOOL_KEYS + ("env_token_share",) if is_multi_turn(steps) else ())
                + (MOE_KEYS if is_moe(steps) else ())
            }
            for r in steps
        ],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(steps, evals, args.title or args.name, RESULTS / f"{args.name}.png")
    rows = "\n".join(
        f"| {e['step']} | {e['elapsed_s']:.0f} | {e['pass_at_1']:.3f} | "
        + " | ".join(f"{e['per_source'][s]['pass_at_1']:.3f}" for s in sorted(e["per_source"]))
        + f" | {e['completion_len_mean']:.1f} | {e['truncated_frac']:.2f} | {e['eval_s']:.0f} |"
        for e in evals
    )
    sources = sorted(first["per_source"])
    print(
        f"eval pass@1 {first['pass_at_1']:.3f} (step {first['step']}) -> {last['pass_at_1']:.3f} (step {last['step']}); "
        f"best {best['pass_at_1']:.3f} (step {best['step']}), final - best = {last['pass_at_1'] - best['pass_at_1']:+.3f}\n"
        f"| step | train s | pass@1 | {' | '.join(sources)} | len | truncated | eval s |\n"
        f"|---|---|---|{'---|' * len(sources)}---|---|---|\n{rows}"
    )
    if is_moe(steps):
        print("\n" + moe_table(steps))


if __name__ == "__main__":
    main()
