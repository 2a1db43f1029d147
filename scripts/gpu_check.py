"""`make gpu-check`: everything a lent GPU should run, in one command that fits one device call.

On the device (its image has torch with CUDA, CuPy and transformers; no Ray, no vLLM) it

  1. installs the wheels `make gpu-wheels` downloaded here (megatron-core, msgspec, pyzmq,
     liger-kernel) with `pip install --no-index --no-deps`;
  2. runs part A of the GPU tier (`pytest tests/gpu -m "gpu and not gpu_e2e"`);
  3. runs the GPU learner benchmark (`benchmarks/bench_learner.py --device cuda`);
  4. runs its VLM row: Qwen2.5-VL-3B's shape at the GPU recipe's image sizes, our learner (`combined`) against
     a plain HF step (`trl`) and the fp32 scoring reference (`--shapes qwen2.5-vl-3b --batch 8x8`);
  5. runs the weight-sync benchmark on CUDA tensors (`benchmarks/bench_weight_sync.py --device cuda`);
  6. finds the longest sequence one GPU trains per model shape (`benchmarks/bench_learner.py --longest`);

each in its own process under its own timeout (a hang costs only that part), all within a total
budget (`--budget-s`, 560 s: one device call is at most 600 s, and the check needs a few seconds
outside its budget to start, write its summary and pack), and writes `benchmarks/results/gpu/<date>-gpu-check.json` and
`.md` (each part: status, seconds, the reason of a skip or failure, its log file) beside what the
benchmarks write there. A part that exits 3 was skipped; its last `SKIP: <reason>` line says why.

`--dry-run` (`make gpu-check DRY=1`): wheels found but not installed, part A only collected, the
benchmarks in their dry modes (a tiny model, one small transfer); where CUDA is absent every CUDA
part skips with its reason. It runs on the CPU machines in seconds (tests/unit/test_gpu_check.py).

The budget's arithmetic (seconds on an H200; * = estimated, never run): wheels 1-3, part A ~200 (202 on
2026-11-28 alone), learner 170 (its timeout; its rows stop at its own budget, 30 s less), VLM 240* (its
timeout: the parent builds and saves the 3.75B model, ~30 s*, then 3 children load it, ~60 s* each), weight-sync
~60*, longest 300*: ~970 s in all. One default call of 560 s runs wheels, part A and the learner, then the VLM
row in what is left (~170 s: its budget may skip its last child, fp32, so no log-prob differences), and names
the rest `not run` (the budget spent). A benchmark part's own `--budget-s` is the time it really has (its timeout or what is left of
the check's, 30 s less), so a part started late stops its rows itself instead of being killed. To measure
one part in a call, skip the others, e.g. the VLM row and the GPU tests (~460 s):

    make gpu-check ARGS="--skip learner --skip weight-sync --skip longest"

Only the standard library here: the script runs under the device's Python before anything is
installed; everything that needs torch runs in the parts' own processes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
EXIT_SKIPPED = 3  # every part: skipped, with `SKIP: <reason>` as its last line
# The wheels the device image lacks (`make gpu-wheels`), by their distribution names in wheel files.
WHEELS = ("megatron_core", "msgspec", "pyzmq", "liger_kernel")
LOG_TAIL_CHARS = 3000
ENV_PROBE = """
import json, platform, sys
info = {"python": platform.python_version()}
try:
    import torch
    info.update(torch=torch.__version__, cuda=torch.version.cuda, gpus=torch.cuda.device_count() if torch.version.cuda else 0)
    if info["gpus"]:
        info["device"] = torch.cuda.get_device_name(0)
except ImportError as e:
    info["torch"] = f"missing ({e})"
print(json.dumps(info))
"""


@dataclass
class Part:
    name: str
    argv: list[str]
    timeout_s: float
    writes: list[Path] = field(default_factory=list)  # the result files it is expected to write
    # A benchmark that stops its own rows: its `--budget-s` value is set when it starts, to the seconds it
    # really has (its timeout, or what is left of the check's budget) less this margin
    budget_margin_s: float | None = None


def with_budget(argv: list[str], seconds: float) -> list[str]:
    """`argv` with the value after its `--budget-s` set to `seconds` (at least 10)."""
    i = argv.index("--budget-s")
    return [*argv[: i + 1], f"{max(seconds, 10):.0f}", *argv[i + 2 :]]


@dataclass
class Outcome:
    name: str
    status: str  # passed | failed | skipped | timed out | not run
    seconds: float
    command: str
    reason: str = ""  # a skip's `SKIP:` line, a failure's last line, or why it did not run
    returncode: int | None = None
    log: str = ""  # the part's full output, beside the summary
    writes: list[str] = field(default_factory=list)  # those of its result files that exist


def find_wheels(folder: Path) -> tuple[list[Path], list[str]]:
    """The newest wheel of every needed distribution in `folder`, and the names with none."""
    found, missing = [], []
    for name in WHEELS:
        matches = sorted(folder.glob(f"{name}-*.whl")) if folder.is_dir() else []
        if matches:
            found.append(matches[-1])
        else:
            missing.append(name)
    return found, missing


def last_line(text: str, prefix: str = "") -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip() and line.strip().startswith(prefix)]
    return lines[-1] if lines else ""


def run_part(part: Part, python_env: dict[str, str], budget_left_s: float, log_dir: Path, tag: str) -> Outcome:
    command = " ".join(part.argv)
    if budget_left_s <= 1:
        return Outcome(part.name, "not run", 0.0, command, reason="the check's total time budget was spent")
    timeout = min(part.timeout_s, budget_left_s)
    if part.budget_margin_s is not None:
        part = Part(part.name, with_budget(part.argv, timeout - part.budget_margin_s), part.timeout_s, part.writes)
        command = " ".join(part.argv)
    log = log_dir / f"{tag}-{part.name}.log"
    print(f"== {part.name} (timeout {timeout:.0f} s): {command}", flush=True)
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            part.argv, cwd=ROOT, env=python_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the part and whatever it started (its own session)
            proc.wait()
            rc = None
    seconds = time.monotonic() - t0
    text = log.read_text(errors="replace")
    rel = str(log.relative_to(ROOT)) if log.is_relative_to(ROOT) else str(log)
    if rc is None:
        status, reason = "timed out", f"killed after {timeout:.0f} s"
    elif rc == 0:
        status, reason = "passed", ""
    elif rc == EXIT_SKIPPED and (skip := last_line(text, "SKIP:")):
        status, reason = "skipped", skip.removeprefix("SKIP:").strip()
    else:
        status, reason = "failed", f"exit {rc}: {last_line(text)[:300]}"
    print(f"   {status} in {seconds:.1f} s{': ' + reason if reason else ''}", flush=True)
    if status != "passed":
        print(text[-LOG_TAIL_CHARS:], flush=True)
    written = [str(w.relative_to(ROOT)) if w.is_relative_to(ROOT) else str(w) for w in part.writes if w.is_file()]
    return Outcome(part.name, status, round(seconds, 1), command, reason, rc, rel, written)


def install_wheels(python: str, wheels: list[Path], missing: list[str], dry_run: bool) -> Part | Outcome:
    command = [python, "-m", "pip", "install", "--no-index", "--no-deps", *map(str, wheels)]
    if missing:
        return Outcome(
            "wheels", "failed", 0.0, " ".join(command), reason=f"no wheel for {', '.join(missing)}: run make gpu-wheels"
        )
    if dry_run:  # found, and the command that would install them
        names = ", ".join(w.name for w in wheels)
        return Outcome("wheels", "passed", 0.0, " ".join(command), reason=f"dry run, not installed: {names}")
    return Part("wheels", command, 90)


def parts(python: str, tag: str, dry_run: bool, out_dir: Path, timeouts: dict[str, float],
          learner_args: list[str], longest_args: list[str], vlm_args: list[str] = ()) -> list[Part]:
    junit = out_dir / f"{tag}-part-a.xml"
    part_a = [python, "-m", "pytest", "tests/gpu", "-m", "gpu and not gpu_e2e", "-rs", "-p", "no:cacheprovider"]
    # -v: the log names each test as it starts, so a hang is named; faulthandler dumps its stack at 60 s.
    part_a += ["-v", "-o", "faulthandler_timeout=60", "--exit-3-without-cuda", f"--junitxml={junit}"]
    # The learner benchmark's contract: --out is relative to benchmarks/results.
    learner_out = RESULTS / "gpu" / f"{tag}-learner"
    # Its own budget ends before the part's timeout, so it writes what it measured instead of being killed
    # (set when it starts: Part.budget_margin_s).
    learner = [python, "benchmarks/bench_learner.py", "--device", "cuda", "--out", f"gpu/{tag}-learner",
               "--budget-s", "0", *learner_args]
    # The VLM row: a small batch (8 prompts x 8 samples, each prompt one image of 256-1,280 tokens) so that
    # its three children (combined, trl, fp32), each loading the 3.75B model, fit its short timeout.
    vlm_out = RESULTS / "gpu" / f"{tag}-vlm"
    vlm = [python, "benchmarks/bench_learner.py", "--device", "cuda", "--out", f"gpu/{tag}-vlm", "--shapes",
           "qwen2.5-vl-3b", "--batch", "8x8", "--score-samples", "8", "--variant-timeout", "150",
           "--budget-s", "0", *vlm_args]
    # The longest sequence per shape: its own budget ends before the part's timeout, as the learner's.
    longest_out = RESULTS / "gpu" / f"{tag}-longest"
    longest = [python, "benchmarks/bench_learner.py", "--longest", "--device", "cuda", "--out", f"gpu/{tag}-longest",
               "--budget-s", "0", *longest_args]
    sync_out = out_dir / f"{tag}-weight-sync.json"
    sync = [python, "benchmarks/bench_weight_sync.py", "--device", "cuda", "--out", str(sync_out)]
    if dry_run:
        part_a.append("--collect-only")
        learner.append("--dry-run")
        vlm.append("--dry-run")  # the tiny VLM shape
        longest.append("--dry-run")
        sync.append("--dry-run")
    else:  # 1 GB of bf16-like tensors into one receiver process (~60 s on an H100), no bucket sweep
        sync += ["--sizes-mb", "1000", "--receivers", "1", "--backends", "cuda_ipc", "--repeats", "3"]
        sync += ["--sweep-buckets-mb"]
    return [
        Part("part-a", part_a, timeouts["part-a"], [junit]),
        Part("learner", learner, timeouts["learner"], [learner_out.with_suffix(".json"), learner_out.with_suffix(".md")],
             budget_margin_s=30),
        Part("vlm", vlm, timeouts["vlm"], [vlm_out.with_suffix(".json"), vlm_out.with_suffix(".md")], budget_margin_s=30),
        Part("weight-sync", sync, timeouts["weight-sync"], [sync_out]),
        Part("longest", longest, timeouts["longest"], [longest_out.with_suffix(".json"), longest_out.with_suffix(".md")],
             budget_margin_s=30),
    ]


def environment(python: str, env: dict[str, str]) -> dict[str, object]:
    probe = subprocess.run([python, "-c", ENV_PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    info: dict[str, object] = {"probe_error": probe.stderr.strip()[-300:]} if probe.returncode else {}
    if probe.returncode == 0:
        info.update(json.loads(last_line(probe.stdout)))
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True, text=True, check=False,
    ) if _has("nvidia-smi") else None
    if smi is not None and smi.returncode == 0:
        info["nvidia_smi"] = smi.stdout.strip()
    try:
        info["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        info["commit"] = "unknown (no git here)"
    info["cpus"] = os.cpu_count()
    return info


def _has(program: str) -> bool:
    return any((Path(d) / program).is_file() for d in os.environ.get("PATH", "").split(os.pathsep) if d)


def pack(archive: Path, tag: str, folders: list[Path]) -> int:
    """Every `<tag>-*` file in `folders` into one gzipped tar (flat names), for a transport that returns
    few files; returns how many went in."""
    files = sorted({f.resolve() for d in folders if d.is_dir() for f in d.glob(f"{tag}-*") if f.is_file()})
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for f in files:
            tar.add(f, arcname=f.name)
    return len(files)


def summary_markdown(tag: str, dry_run: bool, env: dict[str, object], outcomes: list[Outcome], seconds: float) -> str:
    lines = [
        f"# `make gpu-check`{' (dry run)' if dry_run else ''}, {tag}",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in env.items()),
        f"Total: {seconds:.0f} s.",
        "",
        "| part | status | seconds | reason | log | results |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for o in outcomes:
        written = ", ".join(f"`{Path(w).name}`" for w in o.writes) or "-"
        reason = re.sub(r"\s+", " ", o.reason).replace("|", "/")
        lines.append(f"| {o.name} | {o.status} | {o.seconds:.1f} | {reason or '-'} | `{Path(o.log).name if o.log else '-'}` | {written} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="find wheels, collect part A, benchmarks' dry modes")
    ap.add_argument("--python", default=sys.executable, help="the device's Python (GPU_PY); default: this one")
    ap.add_argument("--wheels", default=str(ROOT / ".gpu-wheels"), help="the folder make gpu-wheels filled")
    ap.add_argument("--out-dir", default=str(RESULTS / "gpu"), help="where the summary and the logs go")
    ap.add_argument("--tag", default="", help="file name prefix (default: today's UTC date, '-dry' added in a dry run)")
    ap.add_argument("--budget-s", type=float, default=560, help="the whole check's time limit (a device call: 600 s)")
    # 38 of part A's 44 tests ran in 150 s on an H200 (2026-11-27d), the compiles being most of it
    ap.add_argument("--part-a-timeout-s", type=float, default=240)
    ap.add_argument("--learner-timeout-s", type=float, default=170)
    # the VLM row: the 3.75B model built, then 3 children loading it (estimated, not yet run)
    ap.add_argument("--vlm-timeout-s", type=float, default=240)
    ap.add_argument("--weight-sync-timeout-s", type=float, default=100)
    # covers the 0.5B and 1.5B shapes (estimated, not yet run); all three ~8 minutes: alone in a call, --skip the others
    ap.add_argument("--longest-timeout-s", type=float, default=300)
    ap.add_argument("--skip", action="append", default=[], choices=["part-a", "learner", "vlm", "weight-sync", "longest"],
                    help="leave this part out (repeatable), e.g. a part measured by an earlier call")
    ap.add_argument("--archive", default="", help="also pack every file this check wrote into this .tgz (a device "
                    "call returns at most 8 files: `--archive $OUT/gpu-check.tgz` brings them all back as one)")
    ap.add_argument("--learner-args", default="", help="more options for bench_learner.py --device cuda, one "
                    "string, e.g. \"--variants 'qwen2.5-0.5b=trl,combined' --profile combined --steps 2\"")
    ap.add_argument("--vlm-args", default="", help="more options for the VLM row's bench_learner.py, one string, "
                    "e.g. \"--batch 16x8 --steps 2\"")
    ap.add_argument("--longest-args", default="", help="more options for bench_learner.py --longest, one string, "
                    "e.g. \"--shapes qwen2.5-7b --checkpointing on --time-cap-s 90\"")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    tag = args.tag or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d") + ("-dry" if args.dry_run else "")
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gpu").mkdir(parents=True, exist_ok=True)  # where the learner benchmark writes
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}

    wheels, missing = find_wheels(Path(args.wheels))
    install = install_wheels(args.python, wheels, missing, args.dry_run)
    outcomes: list[Outcome] = []
    if isinstance(install, Part):
        outcomes.append(run_part(install, env, args.budget_s, out_dir, tag))
    else:
        outcomes.append(install)
        print(f"== wheels: {install.status}: {install.reason}", flush=True)
    machine = environment(args.python, env)
    print(f"== machine: {machine}", flush=True)
    timeouts = {"part-a": args.part_a_timeout_s, "learner": args.learner_timeout_s, "vlm": args.vlm_timeout_s,
                "weight-sync": args.weight_sync_timeout_s, "longest": args.longest_timeout_s}
    for part in parts(args.python, tag, args.dry_run, out_dir, timeouts, shlex.split(args.learner_args),
                      shlex.split(args.longest_args), shlex.split(args.vlm_args)):
        if part.name in args.skip:
            outcomes.append(Outcome(part.name, "not run", 0.0, " ".join(part.argv), reason="--skip"))
            continue
        outcomes.append(run_part(part, env, args.budget_s - (time.monotonic() - t0), out_dir, tag))

    seconds = time.monotonic() - t0
    report = {"tag": tag, "dry_run": args.dry_run, "seconds": round(seconds, 1), "machine": machine,
              "parts": [asdict(o) for o in outcomes]}
    (out_dir / f"{tag}-gpu-check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / f"{tag}-gpu-check.md").write_text(summary_markdown(tag, args.dry_run, machine, outcomes, seconds))
    print(f"wrote {out_dir / f'{tag}-gpu-check.md'} ({seconds:.0f} s)")
    for o in outcomes:
        print(f"  {o.name:<12} {o.status:<10} {o.seconds:6.1f} s  {o.reason}")
    if args.archive:
        print(f"packed {pack(Path(args.archive), tag, [out_dir, RESULTS / 'gpu'])} files into {args.archive}")
    return 1 if any(o.status in ("failed", "timed out") for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
