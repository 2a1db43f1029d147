"""Multi-turn environments and agents."""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

from async_rl.config.base import _f, _Section

# verifiers 0.4 resolves an environment id as one top-level module: 'name', 'owner/name' or
# `owner/name@version` (a hub id: verifiers keeps `name`). A dot would fail in its loader.
VERIFIERS_ID_PATTERN = re.compile(r"^(?:[A-Za-z0-9_.-]+/)?[A-Za-z_][A-Za-z0-9_-]*(?:@[A-Za-z0-9_.+-]+)?$")


class EnvConfig(_Section):
    """Multi-turn episodes: the model alternates with an environment (tools, a game) before the reward."""

    name: Annotated[
        str,
        _f("'' = single-turn (one completion per sample); 'tools' (the model may call env.tools before it "
           "answers; task.reward scores the final answer); 'guess' (guess-the-number game, prompts from "
           "task.name 'async_rl.envs.guess:GuessNumberTask'); 'zoom' (a vision-language model answers, sees a crop "
           "of the prompt's image, answers again: docs/vision.md); 'verifiers:ID' (a verifiers 0.4 environment, "
           "run as an agent in env.python: docs/agents.md); 'agent:pkg.module:fn' (a user agent written "
           "against the openai SDK, served by the "
           "engine's OpenAI-compatible endpoint: docs/agents.md); or a factory 'pkg.module:make_env', called as "
           "make_env(env_config, reward) -> Environment"),
    ] = ""
    python: Annotated[
        str,
        _f("env=agent or verifiers: the Python interpreter that runs the agent ('' = the run's own); e.g. a venv "
           "whose packages conflict with ours. It needs the openai SDK and the agent's module (verifiers:ID: "
           "verifiers 0.4, uv and the taskset package ID: docs/agents.md)"),
    ] = ""
    agent_timeout_s: Annotated[
        float,
        _f("env=agent: an agent process still running after this many seconds is killed (with its process "
           "group); its episode scores 0 and counts as a reward timeout", gt=0),
    ] = 300.0
    max_concurrent_agents: Annotated[
        int,
        _f("env=agent or verifiers: agent processes running at once per engine; further episodes wait for a "
           "slot (agent_timeout_s counts from their process's start). Without a bound an eval starts one "
           "process per prompt at once (96 on 2 cores: ~70 MB each, every one lasting the whole eval); "
           "0 = no bound", ge=0),
    ] = 16
    tools: Annotated[
        list[Literal["calculator", "python"]],
        _f("env=tools: the tools the model may call (calculator: arithmetic; python: a program run in a sandbox)"),
    ] = msgspec.field(default_factory=lambda: ["calculator"])
    tool_format: Annotated[
        Literal["tag", "hermes"],
        _f("how the model writes a call: tag (<tool name=\"NAME\">INPUT</tool>, models without a tool format) or "
           "hermes (<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>)"),
    ] = "tag"
    call_bonus: Annotated[
        float,
        _f("env=tools: a shaped reward paid once per episode, for the first turn whose tool calls all ran ok "
           "(0 = off: only task.reward counts); for prompts where calls are too rare to give GRPO a signal", ge=0),
    ] = 0.0
    max_turns: Annotated[int, _f("model turns per episode at most (then it ends: finish 'max_turns')", ge=1)] = 4
    max_total_tokens: Annotated[
        int,
        _f("tokens per episode (prompt, model and environment turns) at most; 0 = generators.max_model_len", ge=0),
    ] = 0
    sandbox_wall_s: Annotated[
        float, _f("python tool: a program is killed (with its process group) after this many seconds", gt=0)
    ] = 5.0
    sandbox_cpu_s: Annotated[int, _f("python tool: CPU seconds a program may use (RLIMIT_CPU)", ge=1)] = 3
    sandbox_memory_mb: Annotated[int, _f("python tool: address space of a program, MiB (RLIMIT_AS)", ge=16)] = 512
    sandbox_output_bytes: Annotated[
        int, _f("python tool: stdout/stderr bytes kept per program (more kills it; the model sees at most this)", ge=1)
    ] = 16_384
