"""`env.name: "verifiers:ID"`: environments of the `verifiers` library (what prime-rl users write).

Not supported, for reasons measured on verifiers 0.4.0 (the current release on the package index):

1. Control is inverted. Our engine owns the episode loop: it generates a model turn token in /
   token out and asks the environment for the next observation (`Episode.step(text)`). A verifiers
   0.4 environment (`verifiers.v1`: Env -> Rollout -> Harness) owns the loop instead: each rollout
   boots a runtime (subprocess, Docker, Podman, Apptainer or a Prime sandbox), serves an HTTP
   interception server on it, and runs a harness program that calls the model at `{base_url}/v1`
   as an OpenAI-compatible chat endpoint (`Client.get_response(dialect, body, ...)` receives the
   whole native request body: messages and function-calling tools). Adapting it would mean parking
   that request until our engine produced the turn, diffing the request's messages against the
   tokens we already hold (a harness may rewrite history, which breaks token in / token out), and
   turning the model's text back into native `tool_calls` (their train client does this with the
   `renderers` library). That is a second rollout system bridged into ours, not an adapter.
2. It does not install cleanly next to our stack: `pip install verifiers` (0.4.0) pulls in ~20
   packages (gepa, mcp, prime-sandboxes, prime-tunnel, prime-runs, renderers, openai-harmony, ...)
   and downgrades `openai` 3.54 -> 2.54 and `mcp` 2.3 -> 2.0 (exact pins), which vLLM's server uses.
3. The pre-0.4 API (`MultiTurnEnv.env_response` / `is_completed`, `Rubric`) would map onto
   `Episode.step` / `final_reward`, but it changed signatures (sync -> async, return shapes) across
   the 0.1.x releases and is gone from the current one; an adapter for it would pin a dead API.

What changed with the OpenAI-compatible endpoint (docs/agents.md): point 1's inverted control is
what `env.name: agent:...` serves (the agent owns the loop, every call is recorded token in / token
out) and point 2 is what `env.python` is for: verifiers 0.4.0 installs into its own venv (checked:
it brings openai 2.54 and mcp 2.0 there, ours untouched). What still stands in the way, read in
verifiers 0.4.0 (`verifiers/v1/env.py`, `utils/loaders.py`): no bridge is written that runs
`Env.run_episode(task, ModelContext(model, ClientConfig(base_url=...)))` per episode as an agent,
and an environment ID names a taskset package that must already be installed (verifiers ships none
of its own but the Harbor, NeMo-Gym and OpenEnv bridges, which need their own servers or
containers); its rollouts also start a harness program in a runtime (subprocess, Docker, ...).

So `build` fails with one line that says this; nothing is imported at module load.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from async_rl.errors import ConfigError

if TYPE_CHECKING:
    from async_rl.envs.base import Environment
    from async_rl.envs.tool_env import RewardFn


def _installed_version() -> str | None:
    """The installed verifiers version, or None when the library is not installed."""
    if importlib.util.find_spec("verifiers") is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("verifiers")
    except PackageNotFoundError:
        return "unknown"


def build(env_id: str, cfg: object, reward: RewardFn) -> Environment:
    """The Environment for `env.name: "verifiers:<env_id>"`; always a ConfigError (see the module doc)."""
    found = _installed_version()
    where = f"verifiers {found} is installed" if found else "verifiers is not installed"
    raise ConfigError(
        f"env.name 'verifiers:{env_id}' is not supported ({where}): no bridge runs a verifiers 0.4 Env's "
        "run_episode against the engine's OpenAI endpoint yet, and its taskset must be an installed package; "
        "run your loop as env.name 'agent:pkg.module:fn' (env.python for a verifiers venv, docs/agents.md)"
    )
