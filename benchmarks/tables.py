"""Markdown tables from the benchmark JSON under benchmarks/results/, for the README.

    python benchmarks/tables.py [--quick]     # reads e2e.json, transport.json, scaling.json (or *-quick.json)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def mmm(d: dict, fmt: str = ".1f") -> str:
    return f"{d['min']:{fmt}} / **{d['median']:{fmt}}** / {d['max']:{fmt}}"


def e2e(data: dict) -> str:
    rows = data["rows"]
    base = rows[0]["samples_per_s"]["median"]
    out = ["| setting | samples/s min / **med** / max | vs sync | tokens/s | learner idle | generator idle | sync s/step |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        li, gi = r["learner_idle_frac"]["median"], r["generator_idle_frac"]["median"]
        pct = lambda x: "n/a" if x != x else f"{x:.0%}"  # noqa: E731 - NaN: TRL reports no idle split
        out.append(f"| {r['setting']} | {mmm(r['samples_per_s'])} | {r['samples_per_s']['median'] / base:.2f}x | "
                   f"{r['tokens_per_s']['median']:.0f} | {pct(li)} | {pct(gi)} | {r['sync_s_per_step']:.3f} |")
    ph = data.get("phases_s") or {}
    if ph.get("gen"):
        cells = ", ".join(f"{k} {c} core(s) {v:.2f} s" for k in ("gen", "train") for c, v in ph[k].items())
        out.append(f"\nPhases (median s per batch): {cells}; async/sync ceiling from phases: {data['async_ceiling']:.2f}x.")
    return "\n".join(out)


def transport(data: dict) -> str:
    out = ["| transport | tokens | producers | trajectories/s min / **med** / max | MB/s | p50 ms | p99 ms |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in data["rows"]:
        extra = f" (buffer CPU {r['buffer_cpu_us_per_traj']:.0f} us/traj)" if "buffer_cpu_us_per_traj" in r else ""
        p50 = "" if r["p50_ms"] != r["p50_ms"] else f"{r['p50_ms']:.2f}"
        p99 = "" if r["p99_ms"] != r["p99_ms"] else f"{r['p99_ms']:.2f}"
        out.append(f"| {r['transport']} | {r['tokens']} | {r['producers']} | {mmm(r['traj_per_s'], '.0f')}{extra} | "
                   f"{r['mb_per_s']:.1f} | {p50} | {p99} |")
    ratios = ", ".join(f"{k.replace('x', ' tokens x ')} producers {v:.1f}x" for k, v in data["ours_over_ray"].items())
    out.append(f"\nOurs / Ray (median trajectories/s): {ratios}.")
    return "\n".join(out)


def scaling(data: dict) -> str:
    out = []
    if data["generation"]:
        out += ["| generator pool | cores | samples/s min / **med** / max | tokens/s min / **med** / max |",
                "| --- | --- | ---: | ---: |"]
        for g in data["generation"]:
            out.append(f"| {g['engines']} engine(s) | {g['cores']} | {mmm(g['samples_per_s'])} | {mmm(g['tokens_per_s'], '.0f')} |")
        out.append("")
    out += ["| producers | offered/s | sent/s | accepted/s min / **med** / max | ingest latency ms | control call p50 / p99 ms | buffer CPU |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in data["control_plane"]:
        out.append(f"| {r['producers']} | {r['offered_per_s']:.0f} | {r['sent_per_s']:.0f} | {mmm(r['accepted_per_s'], '.0f')} | "
                   f"{r['ingest_latency_ms']:.1f} | {r['control_call_p50_ms']:.1f} / {r['control_call_p99_ms']:.1f} | "
                   f"{r['buffer_cpu_frac']:.0%} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    suffix = "-quick" if args.quick else ""
    for name, render in (("e2e", e2e), ("transport", transport), ("scaling", scaling)):
        path = RESULTS / f"{name}{suffix}.json"
        if path.exists():
            print(f"### {path.name}\n\n{render(json.loads(path.read_text()))}\n")


if __name__ == "__main__":
    main()
