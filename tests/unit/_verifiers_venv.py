"""Where the tests find a verifiers 0.4 venv (`make verifiers-venv`, or ASYNC_RL_VERIFIERS_PYTHON), and
why not: the tests that run real verifiers episodes skip with that reason."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VF_PYTHON = os.environ.get("ASYNC_RL_VERIFIERS_PYTHON", str(REPO / ".venv-verifiers" / "bin" / "python"))
EXAMPLES = REPO / "examples" / "vf_arith"  # the example tasksets, put on the agents' PYTHONPATH


def examples_pythonpath() -> str:
    return os.pathsep.join([str(EXAMPLES), os.environ.get("PYTHONPATH", "")])


def unavailable() -> str | None:
    """Why this machine cannot run verifiers episodes (None: it can). Call with the examples on PYTHONPATH."""
    from async_rl.envs.verifiers_env import check_interpreter
    from async_rl.errors import ConfigError

    if not Path(VF_PYTHON).is_file():
        return f"no verifiers venv at {VF_PYTHON}: `make verifiers-venv` (or set ASYNC_RL_VERIFIERS_PYTHON)"
    if not (Path(VF_PYTHON).parent / "uv").is_file():
        return f"no uv next to {VF_PYTHON} (verifiers prepares its harness programs with it): pip install uv there"
    try:
        check_interpreter(VF_PYTHON, "vf-arith")
    except ConfigError as exc:
        return str(exc)
    return None
