"""A busy machine on purpose: processes that each spin on a core, as another test running beside
this one would. Started and stopped by their handles."""

from __future__ import annotations

import os
import subprocess
import sys


def start_burners(count: int | None = None, nice: int = 0) -> list[subprocess.Popen]:
    """`count` spinning processes (default: one per core) at niceness `nice` (Ray starts its workers,
    so every process of a run but the driver, at 15: burners at 0 take nearly all of a core from them)."""
    code = f"import os; os.nice({nice})\nwhile True: pass" if nice else "while True: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count or os.cpu_count() or 2)]


def stop_burners(procs: list[subprocess.Popen]) -> None:
    """Stop them (those already stopped too)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
