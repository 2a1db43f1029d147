"""The environment a child Python interpreter runs with: an agent's process, or the check that a
verifiers interpreter resolves an environment id."""

from __future__ import annotations

import os
import sys


def child_env(python: str) -> dict[str, str]:
    """Our interpreter sees our import path (the user's module may live in this checkout); another
    interpreter keeps its own packages and gets only the working directory and PYTHONPATH."""
    env = dict(os.environ)
    paths = [os.getcwd()] + ([p for p in sys.path if p and os.path.isdir(p)] if python == sys.executable else [])
    old = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join(paths + ([old] if old else []))
    return env
