"""`python -m async_rl.launch` in a child process, as a user starts it from a terminal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _sigint_default() -> None:
    # A shell without job control starts background commands with SIGINT ignored, and the child
    # inherits that: Python then installs no KeyboardInterrupt handler and Ctrl-C tests would see
    # the run go on. A terminal's foreground process has the default disposition: give it that.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def launch(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`env`: variables added to this process's environment for the run (and its Ray workers)."""
    return subprocess.Popen(
        [sys.executable, "-m", "async_rl.launch", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_sigint_default,
        env={**os.environ, **env} if env else None,
    )
