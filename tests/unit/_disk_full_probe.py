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
from async_rl.config import WandbConfig
from async_rl.control.metrics import MetricsSink, StepRecord
from async_rl.errors import RunError

root = Path(sys.argv[1])
big = {"w": torch.zeros(64 * 1024)}  # 256 KiB: more than the filesystem holds


def python_write() -> None:
    with open(root / "metrics.jsonl", "wb") as fh:
        fh.write(b"x" * (256 << 10))


def metrics_record() -> None:
    sink = MetricsSink(root, WandbConfig(mode="disabled"), {}, 10, stream=sys.stderr)
    with open(root / "filler", "wb", buffering=0) as fh:  # then the run directory fills up, as another writer's would
        try:
            while True:
                fh.write(b"f" * 1024)
                fh.flush()
        except OSError:
            pass
    fields = {f.name: 0 for f in msgspec.structs.fields(StepRecord) if f.required}
    record = msgspec.convert({**fields, "step": 3, "accounting_balanced": True}, StepRecord)
    try:
        sink.log(record)
    except RunError as exc:
        raise OSError(28, f"RunError: {exc}") from exc  # reported as a failed write; the line is the RunError's


writes = {"metrics.jsonl": metrics_record, "torch.save": lambda: torch.save(big, root / "trainer_state.pt"),
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
