"""Run inside a mount namespace (tests/unit/test_storage.py) with argv[1] a tmpfs: a run's checkpoint is
written there, the tmpfs is remounted read-only, and the next checkpoint is tried as the controller
tries it. Prints the line a user would see."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from async_rl import storage
from async_rl.control import checkpoint
from tests.unit.test_checkpoint_partial import write

root = Path(sys.argv[1])
write(root, 4, weights=b"w" * 4096)
subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
try:
    checkpoint.begin(root)  # Controller.save_checkpoint's first write
    print("did not fail")
except OSError as exc:
    assert not storage.out_of_space(exc), exc
    why = storage.place_problem(root)
    print(checkpoint.unwritable(root, root / "checkpoints" / ".tmp-none", 6, why or f"? {exc}"))
