"""Run inside a mount namespace with a 64 KiB tmpfs at argv[1] (tests/unit/test_storage.py): each of the
writes a run makes fails for lack of space there; prints one JSON line per write: its out_of_space verdict
and the line a user would see."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from async_rl import storage

root = Path(sys.argv[1])
big = {"w": torch.zeros(64 * 1024)}  # 256 KiB: more than the filesystem holds


def python_write() -> None:
    with open(root / "metrics.jsonl", "wb") as fh:
        fh.write(b"x" * (256 << 10))


writes = {"torch.save": lambda: torch.save(big, root / "trainer_state.pt"),
          "safetensors": lambda: save_file(big, str(root / "model.safetensors")),
          "python": python_write}
for name, write in writes.items():
    try:
        write()
        print(json.dumps({"write": name, "failed": False}))
    except Exception as exc:  # noqa: BLE001 - each failure is what the probe reports
        print(json.dumps({"write": name, "failed": True, "out_of_space": storage.out_of_space(exc),
                          "error": str(exc)[:200], "line": storage.space_line(name, root, 1 << 18)}))
    for f in root.iterdir():
        f.unlink()
