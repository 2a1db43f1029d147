"""Run inside a mount namespace with a 64 KiB tmpfs at argv[1] (tests/unit/test_storage.py): each of the
writes a run makes fails for lack of space there; prints one JSON line per write: its out_of_space verdict
and the line a user would see."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import torch
from safetensors.torch import save_file

from async_rl import storage
from async_rl.buffer.actor import BufferSettings, ReplayBuffer
from async_rl.buffer.snapshot import SNAPSHOT_NAME
from async_rl.config import WandbConfig
from async_rl.control.metrics import MetricsSink, StepRecord
from async_rl.errors import RunError

root = Path(sys.argv[1])
big = {"w": torch.zeros(64 * 1024)}  # 256 KiB: more than the filesystem holds


def python_write() -> None:
    with open(root / "metrics.jsonl", "wb") as fh:
        fh.write(b"x" * (256 << 10))


def fill() -> None:
    """The run directory fills up, as another writer's would."""
    with open(root / "filler", "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"f" * 1024)
                fh.flush()
        except OSError:
            pass


def metrics_record() -> None:
    sink = MetricsSink(root, WandbConfig(mode="disabled"), {}, 10, stream=sys.stderr)
    fill()
    fields = {f.name: 0 for f in msgspec.structs.fields(StepRecord) if f.required}
    record = msgspec.convert({**fields, "step": 3, "accounting_balanced": True}, StepRecord)
    try:
        sink.log(record)
    except RunError as exc:
        raise OSError(28, f"RunError: {exc}") from exc  # reported as a failed write; the line is the RunError's


def buffer_snapshot() -> None:
    path = root / SNAPSHOT_NAME
    buf = ReplayBuffer(BufferSettings(
        run_id="r", host="127.0.0.1", ingest_port=0, serve_port=0, max_lag=1, prompts_per_step=2, group_size=2,
        filter_uniform_groups=False, max_frame_bytes=1 << 20, task_name="repeat", task_seed=0, snapshot_path=str(path),
    ))
    buf.save_snapshot()  # the first one fits
    before = path.read_bytes()
    fill()
    buf.save_snapshot()  # the serve loop goes on: the failure is in the stats, for the supervisor's line
    if path.read_bytes() != before or path.with_name(path.name + ".tmp").exists():
        raise AssertionError("the previous snapshot was not left whole")
    error = buf.stats().storage_error
    if error:
        raise OSError(28, f"RunError: {error}")


writes = {"buffer snapshot": buffer_snapshot, "metrics.jsonl": metrics_record, "torch.save": lambda: torch.save(big, root / "trainer_state.pt"),
          "safetensors": lambda: save_file(big, str(root / "model.safetensors")),
          "python": python_write}
for name, write in writes.items():
    try:
        write()
        print(json.dumps({"write": name, "failed": False}))
    except Exception as exc:  # noqa: BLE001 - each failure is what the probe reports
        ours = str(exc).removeprefix("[Errno 28] ") if str(exc).startswith("[Errno 28] RunError: ") else ""
        line = ours.removeprefix("RunError: ") or storage.space_line(name, root, 1 << 18)
        print(json.dumps({"write": name, "failed": True, "out_of_space": storage.out_of_space(exc),
                          "error": str(exc)[:200], "line": line}))
    for f in root.iterdir():
        f.unlink()
