"""Did a run repeat? Two run directories' learning values compared step by step.

A `train.deterministic` run writes the same values to metrics.jsonl and eval.jsonl as any other run
of its config and seeds (docs/determinism.md). What depends on when things happened is left out:
timings and throughput, and counts read from the buffer or the engines at a moment in the step
(how many groups were waiting, what was leased or in flight, how far the prompt stream was drawn).

    python -m async_rl.control.repeat RUN_A RUN_B [--across-faults]   # exit 0: identical; 1: the first differences

The newest checkpoints' parameters are compared too, byte for byte.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from async_rl.control.checkpoint import completed
from async_rl.control.checkpoint_manifest import file_digest

# metrics.jsonl (control/metrics.py StepRecord): values that depend on timing, not on what was learned
STEP_TIMING_FIELDS = frozenset({
    "elapsed_s", "samples_per_s", "tokens_per_s", "learner_wait_s", "learner_compute_s", "sync_s", "settle_s",
    # the buffer's state when the step's stats were read: engines run ahead of the learner by up to max_lag
    "buffer_waiting_groups", "leased", "in_flight", "waiting", "data_epoch", "data_index",
    # the engines' counters "so far", read while they generate the next steps
    "rollout_episodes", "agent_calls", "agent_prefix_breaks", "agent_segments", "agent_errors", "agent_timeouts",
    "agent_crashes", "agent_refused", "reward_model_calls", "reward_model_unparseable", "reward_model_failures",
    "reward_model_timeouts", "teacher_tokens", "teacher_tokens_per_s", "teacher_share", "teacher_unscored",
    "teacher_failures", "teacher_timeouts",
})
EVAL_TIMING_FIELDS = frozenset({"elapsed_s", "eval_s"})
# What a fault did to the processes, not to learning: a run killed and resumed, or one whose engine was
# replaced, hands leases back (requeued), counts its restarts, and runs short of an engine while the
# replacement starts in the background (num_engines); compared with `across_faults`
FAULT_FIELDS = frozenset({"requeued", "lost", "recoveries", "failed_starts", "replayed", "rejected_frames",
                          "reassigned_prompts", "dead_engines", "num_engines"})


def read_records(path: Path) -> list[dict]:
    """The records of a metrics.jsonl or eval.jsonl ([] when the file is absent); a step logged again
    after a learner recovery (`replayed`) counts by its later record."""
    if not path.exists():
        return []
    by_step: dict[int, dict] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not a JSON record ({exc.msg})") from None
        by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def learning_values(record: dict, timing: frozenset[str]) -> dict:
    return {k: v for k, v in record.items() if k not in timing}


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def differences(run_a: Path, run_b: Path, limit: int = 10, across_faults: bool = False) -> list[str]:
    """Up to `limit` lines, one per differing value (file, step, key, both values); [] = the runs repeat.
    `across_faults`: the counts of what faults did (FAULT_FIELDS) are left out too."""
    out: list[str] = []
    faults = FAULT_FIELDS if across_faults else frozenset()
    for name, timing in (("metrics.jsonl", STEP_TIMING_FIELDS | faults), ("eval.jsonl", EVAL_TIMING_FIELDS | faults)):
        a, b = read_records(run_a / name), read_records(run_b / name)
        if [r["step"] for r in a] != [r["step"] for r in b]:
            out.append(f"{name}: steps {[r['step'] for r in a]} vs {[r['step'] for r in b]}")
        for ra, rb in zip(a, b, strict=False):
            va, vb = learning_values(ra, timing), learning_values(rb, timing)
            for key in sorted(va.keys() | vb.keys()):
                if not _same(va.get(key), vb.get(key)):
                    out.append(f"{name} step {ra['step']}: {key} {va.get(key)!r} vs {vb.get(key)!r}")
                    if len(out) >= limit:
                        return out
    return out


def parameter_differences(run_a: Path, run_b: Path) -> list[str]:
    """The newest checkpoints' parameters (their model/ files, byte for byte); [] = the same."""
    a, b = ((found[-1] if (found := completed(run)) else None) for run in (run_a, run_b))
    if a is None or b is None:
        return [] if a is b else [f"checkpoints: {a} vs {b}"]
    if a.name != b.name:
        return [f"checkpoints: newest {a.name} vs {b.name}"]
    files_a = sorted(p.relative_to(a) for p in (a / "model").rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in (b / "model").rglob("*") if p.is_file())
    if files_a != files_b:
        return [f"{a.name}/model: files {[str(f) for f in files_a]} vs {[str(f) for f in files_b]}"]
    return [f"{a.name}/{f}: the bytes differ" for f in files_a if file_digest(a / f) != file_digest(b / f)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m async_rl.control.repeat", description=__doc__.splitlines()[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument(
        "--across-faults", action="store_true",
        help="leave out the counts of what faults did (leases handed back, restarts): one run was killed and resumed",
    )
    args = parser.parse_args(argv)
    for run in (args.run_a, args.run_b):
        if not (run / "metrics.jsonl").exists():
            print(f"error: {run}: no metrics.jsonl (not a run directory)", file=sys.stderr)
            return 2
    diffs = differences(args.run_a, args.run_b, across_faults=args.across_faults) + parameter_differences(args.run_a, args.run_b)
    if not diffs:
        steps = len(read_records(args.run_a / "metrics.jsonl"))
        print(f"identical: {steps} step(s) of learning values in metrics.jsonl and eval.jsonl, and the newest "
              "checkpoint's parameters")
        return 0
    print("\n".join(diffs))
    return 1


if __name__ == "__main__":
    sys.exit(main())
