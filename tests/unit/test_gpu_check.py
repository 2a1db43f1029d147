"""`make gpu-check DRY=1` on the CPU: the wheels are found (placeholders here: no download in tests),
every part starts in its own process, and the parts that need CUDA skip, each naming what is
missing (exit 3 and a last `SKIP:` line), so the first call on a lent device is also the last."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WHEELS = [
    "megatron_core-0.16.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
    "msgspec-0.22.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
    "pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl",
    "liger_kernel-0.8.5-py3-none-any.whl",
]


def gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run's CUDA parts skip only where CUDA is absent")
def test_dry_run_finds_the_wheels_starts_every_part_and_the_cuda_parts_skip_with_their_reason(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in WHEELS:
        (wheels / name).write_bytes(b"")
    out = tmp_path / "out"
    argv = [sys.executable, "scripts/gpu_check.py", "--dry-run", "--wheels", str(wheels), "--out-dir", str(out)]
    archive = tmp_path / "back" / "all.tgz"
    proc = subprocess.run([*argv, "--tag", "t", "--archive", str(archive)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = json.loads((out / "t-gpu-check.json").read_text())
    parts = {p["name"]: p for p in report["parts"]}
    assert list(parts) == ["wheels", "part-a", "learner", "vlm", "weight-sync", "longest"]
    assert parts["wheels"]["status"] == "passed" and all(name in parts["wheels"]["reason"] for name in WHEELS)
    assert "--no-index --no-deps" in parts["wheels"]["command"]
    assert "--shapes qwen2.5-vl-3b" in parts["vlm"]["command"] and "--dry-run" in parts["vlm"]["command"]
    for name in ("part-a", "learner", "vlm", "weight-sync", "longest"):
        part = parts[name]
        assert "--device cuda" in part["command"] or name == "part-a"
        assert (part["status"], part["returncode"]) == ("skipped", 3), part
        assert "CUDA" in part["reason"], part  # says what is missing
        assert (ROOT / part["log"]).is_file() if not Path(part["log"]).is_absolute() else Path(part["log"]).is_file()
    summary = (out / "t-gpu-check.md").read_text()
    assert "| part-a | skipped |" in summary and "(dry run)" in summary
    with tarfile.open(archive) as tar:  # one file carries every result back from a device call
        names = set(tar.getnames())
    assert {"t-gpu-check.json", "t-gpu-check.md", "t-part-a.log", "t-learner.log", "t-vlm.log", "t-longest.log"} <= names, names


def test_missing_wheels_are_named_with_the_command_that_fetches_them(tmp_path):
    gc = gpu_check_module()
    (tmp_path / WHEELS[0]).write_bytes(b"")
    (tmp_path / WHEELS[3]).write_bytes(b"")
    found, missing = gc.find_wheels(tmp_path)
    assert [w.name for w in found] == [WHEELS[0], WHEELS[3]] and missing == ["msgspec", "pyzmq"]
    outcome = gc.install_wheels("python3", found, missing, dry_run=False)
    assert outcome.status == "failed" and outcome.reason == "no wheel for msgspec, pyzmq: run make gpu-wheels"
    for name in WHEELS[1:3]:
        (tmp_path / name).write_bytes(b"")
    part = gc.install_wheels("python3", *gc.find_wheels(tmp_path), dry_run=False)
    assert part.argv[:6] == ["python3", "-m", "pip", "install", "--no-index", "--no-deps"] and len(part.argv) == 10


def test_a_part_is_skipped_only_with_its_reason_and_a_hang_costs_only_its_timeout(tmp_path):
    gc = gpu_check_module()

    def run(code: str, timeout_s: float = 60, budget_s: float = 60):
        part = gc.Part("p", [sys.executable, "-c", code], timeout_s)
        return gc.run_part(part, {}, budget_s, tmp_path, "t")

    skipped = run("import sys; print('SKIP: needs CUDA: none here'); sys.exit(3)")
    assert (skipped.status, skipped.reason) == ("skipped", "needs CUDA: none here")
    silent = run("import sys; print('no reason given'); sys.exit(3)")  # exit 3 without its reason
    assert silent.status == "failed" and silent.reason == "exit 3: no reason given"
    hung = run("import time; print('started', flush=True); time.sleep(600)", timeout_s=1)
    assert (hung.status, hung.returncode) == ("timed out", None) and "started" in (tmp_path / "t-p.log").read_text()
    assert run("print('x')", budget_s=0).status == "not run"  # the check's budget is spent


def test_a_benchmark_part_is_given_the_seconds_it_really_has_as_its_own_budget(tmp_path):
    """A benchmark stops its own rows at its --budget-s: set when it starts, to its timeout or what is left of
    the check's budget, less its margin; the default parts fit one 600 s device call."""
    gc = gpu_check_module()
    timeouts = {"part-a": 240, "learner": 170, "vlm": 240, "weight-sync": 100, "longest": 300}
    by_name = {p.name: p for p in gc.parts("python3", "t", False, tmp_path, timeouts, [], [], [])}
    vlm = by_name["vlm"]
    assert vlm.budget_margin_s == 30 and "qwen2.5-vl-3b" in vlm.argv and vlm.timeout_s == 240
    code = "import sys; print('BUDGET', sys.argv[sys.argv.index('--budget-s') + 1])"
    part = gc.Part("b", [sys.executable, "-c", code, "--budget-s", "0"], 240, budget_margin_s=30)
    for left, want in ((1000, "210"), (100, "70"), (20, "10")):
        outcome = gc.run_part(part, {}, left, tmp_path, f"t{left}")
        assert outcome.status == "passed" and f"--budget-s {want}" in outcome.command
        assert f"BUDGET {want}" in (tmp_path / f"t{left}-b.log").read_text()
    # what a caller passes later (--learner-args "... --budget-s 370") still wins: argparse takes the last
    assert gc.with_budget(["x", "--budget-s", "0", "--budget-s", "370"], 50)[-2:] == ["--budget-s", "370"]
