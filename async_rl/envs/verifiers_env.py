"""`env.name: "verifiers:ID"`: environments of the `verifiers` library (what prime-rl users write),
run through the engine's OpenAI-compatible endpoint like any agent (docs/agents.md, 'verifiers').

Measured on verifiers 0.4.0 (the current release on the package index):

- Control is inverted: a verifiers 0.4 environment (`verifiers.v1`: Env -> Rollout -> Harness) owns
  the episode loop. Each rollout boots a runtime, serves an HTTP interception server and runs a
  harness program (a PEP 723 script prepared by `uv`) that calls the model at an OpenAI-compatible
  endpoint. That is what `env.name: agent:...` serves, so `verifiers:ID` is an agent: the bridge
  `async_rl/agents/verifiers_bridge.py:run_episode` builds the environment with verifiers' own
  loader (`utils/loaders.py`: `resolve_env_config` + `load_environment`) and runs one
  `Env.run_episode(task, ModelContext(model, EvalClientConfig(base_url=<episode route>)))` per
  episode; every model call of the harness program goes through verifiers' interception server to
  the endpoint and is recorded token in / token out (tested: tests/unit/test_verifiers.py,
  tests/integration/test_verifiers_real.py).
- It does not install next to our stack (`pip install verifiers==0.4.0` pins openai 2.54 and mcp
  2.0; ours has openai 3.x and mcp 2.3, which vLLM's server uses), so it runs under `env.python`, a
  venv of its own (docs/agents.md gives the commands; measured: ~40 s to install on the 2-core
  machine with a warm pip cache).
- Its harness programs always stream (`harnesses/utils/core.py` calls `chat.completions.create(
  stream=True)` and `clients/eval.py` relays a streamed request as a stream), so the endpoint answers
  `stream: true` with the whole completion as server-sent events (`async_rl/endpoint/streaming.py`).
- Runtimes: every seat runs in verifiers' `subprocess` runtime (`runtimes/subprocess.py`), on the
  engine's node, no container; its default (`PrimeConfig`, a remote sandbox) and Docker/Podman/
  Apptainer/Modal/E2B are not used. `Runtime.prepare_uv_script` (`runtimes/base.py`) needs `uv`
  (the bridge puts the venv's `bin` first on PATH, so `pip install uv` there) and an index for the
  script's dependencies on first use (cached after).
- IDs: verifiers resolves an ID to an importable top-level module (`_import_plugin` in
  `utils/loaders.py` imports `name.replace('-', '_')` or `verifiers.v1.tasksets.<name>`; a dotted
  name fails in its `find_spec`), so a taskset is an installed package (or on `PYTHONPATH`), e.g.
  `examples/vf_arith` as `verifiers:vf-arith`. verifiers itself ships only its Harbor, NeMo-Gym and
  OpenEnv tasksets, which need their own servers or containers (not tried).

So `build` checks, once per process, that the interpreter imports verifiers 0.4 and resolves ID (one
line naming what failed), and returns no Environment: the engine runs `verifiers:ID` as an agent.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from typing import TYPE_CHECKING

from async_rl.config import verifiers_id_error as id_error  # the id check config loading makes
from async_rl.envs.interpreter import child_env
from async_rl.errors import ConfigError

if TYPE_CHECKING:
    from async_rl.config import EnvConfig
    from async_rl.envs.base import Environment
    from async_rl.envs.tool_env import RewardFn

SUPPORTED = "0.4."  # the verifiers releases the bridge is written against
# Run by the agent's interpreter: the verifiers version, then the taskset class ID resolves to.
_CHECK = """
import sys
import verifiers
print(verifiers.__version__)
from verifiers.v1.utils.loaders import taskset_class
print(taskset_class(sys.argv[1]).__name__)
"""


@functools.cache
def check_interpreter(python: str, env_id: str, timeout_s: float = 120.0) -> str:
    """The verifiers version of `python` after it resolved `env_id` to a taskset; a one-line
    ConfigError naming the failure otherwise."""
    where = f"env.python '{python}'" if python != sys.executable else "this interpreter (env.python is '')"
    try:
        done = subprocess.run([python, "-c", _CHECK, env_id], capture_output=True, text=True, timeout=timeout_s,
                              env=child_env(python), stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"env.name 'verifiers:{env_id}': cannot run {where}: {exc}") from None
    out = done.stdout.split()
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        if not out:
            why = "does not import verifiers (make a venv with verifiers==0.4.0: docs/agents.md)"
        else:
            why = f"has verifiers {out[0]} but does not resolve the taskset"
        raise ConfigError(f"env.name 'verifiers:{env_id}': {where} {why}: {last}")
    if not out[0].startswith(SUPPORTED):
        raise ConfigError(f"env.name 'verifiers:{env_id}': {where} has verifiers {out[0]}; the bridge needs {SUPPORTED}x")
    return out[0]


def build(env_id: str, cfg: EnvConfig, reward: RewardFn) -> Environment | None:
    """None (the engine runs `verifiers:<env_id>` as an agent) once the interpreter resolves it."""
    why = id_error(env_id)
    if why:
        raise ConfigError(f"env.name 'verifiers:{env_id}' {why}")
    check_interpreter(cfg.python or sys.executable, env_id)
    return None
