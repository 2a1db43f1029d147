"""`python -m async_rl.launch` in a child process, as a user starts it from a terminal, and the tree of
processes it starts (none may outlive it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]


def _sigint_ignored() -> None:
    # The hard case: a shell without job control starts background commands with SIGINT ignored and
    # the child inherits that (Python then installs no KeyboardInterrupt handler of its own). The
    # launcher installs one itself, so the Ctrl-C tests stop a run started this way too.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def launch(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`env`: variables added to this process's environment for the run (and its Ray workers)."""
    return subprocess.Popen(
        [sys.executable, "-m", "async_rl.launch", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_sigint_ignored,
        env={**os.environ, **env} if env else None,
    )


class ProcessTree:
    """Remembers every descendant a process ever had, to check none survives it."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.seen: dict[int, psutil.Process] = {}

    def poll(self) -> None:
        try:
            for child in self.root.children(recursive=True):
                self.seen.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            pass

    def names(self) -> list[str]:
        out = []
        for p in self.seen.values():
            try:
                out.append(f"{p.name()} {' '.join(p.cmdline())}")
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                pass
        return out

    def survivors(self, timeout: float = 30.0) -> list[str]:
        _, alive = psutil.wait_procs(list(self.seen.values()), timeout=timeout)
        return [f"{p.pid} {p.name()}" for p in alive]
