"""The environment named by the `env` config section, built in each generator engine.

'' is no environment (single-turn samples); 'tools', 'guess' and 'zoom' (vision-language) are built in; 'verifiers:ID' (a
verifiers 0.4 environment) and 'agent:pkg.module:fn' run as agents, not Environments: here they are
only checked (`async_rl.envs.verifiers_env`, imported only then, checks the interpreter); anything
else is a factory 'pkg.module:make_env' called as make_env(env_config, reward) -> Environment.
"""

from __future__ import annotations

import importlib

from async_rl.config import EnvConfig
from async_rl.envs.base import Environment
from async_rl.envs.sandbox import SandboxLimits
from async_rl.envs.tool_env import RewardFn
from async_rl.envs.tools import BUILTIN_TOOLS, PythonTool, Tool
from async_rl.errors import ConfigError
from async_rl.protocol import Sample

VERIFIERS_PREFIX = "verifiers:"
AGENT_PREFIX = "agent:"


def sandbox_limits(cfg: EnvConfig) -> SandboxLimits:
    return SandboxLimits(
        wall_s=cfg.sandbox_wall_s,
        cpu_s=cfg.sandbox_cpu_s,
        memory_mb=cfg.sandbox_memory_mb,
        output_bytes=cfg.sandbox_output_bytes,
    )


def make_tools(cfg: EnvConfig) -> list[Tool]:
    tools: list[Tool] = []
    for name in cfg.tools:
        if name not in BUILTIN_TOOLS:
            raise ConfigError(f"env.tools: unknown tool '{name}' (built in: {sorted(BUILTIN_TOOLS)})")
        tools.append(PythonTool(sandbox_limits(cfg)) if name == "python" else BUILTIN_TOOLS[name]())
    return tools


def build_environment(cfg: EnvConfig, reward: RewardFn) -> Environment | None:
    """The configured environment (None: single-turn). `reward` scores a final answer (a Sample)."""
    if not cfg.name:
        return None
    if cfg.name == "tools":
        from async_rl.envs.tool_env import ToolEnvironment

        return ToolEnvironment(make_tools(cfg), reward, cfg.tool_format, call_bonus=cfg.call_bonus)
    if cfg.name == "guess":
        from async_rl.envs.guess import GuessNumberEnvironment

        return GuessNumberEnvironment()
    if cfg.name == "zoom":
        from async_rl.envs.zoom import ZoomEnvironment

        return ZoomEnvironment(reward)
    if cfg.name.startswith(AGENT_PREFIX):
        # Agents are not Environments: the engine runs them against its endpoint (async_rl/agents/).
        # Checked here so that a bad name fails at startup, in the prompt source, with one line.
        if cfg.name.count(":") != 2 or not all(cfg.name.split(":")[1:]):
            raise ConfigError(f"env.name '{cfg.name}' is not 'agent:pkg.module:fn'")
        return None
    if cfg.name.startswith(VERIFIERS_PREFIX):
        try:
            module = importlib.import_module("async_rl.envs.verifiers_env")
        except ModuleNotFoundError as exc:
            raise ConfigError(f"env.name '{cfg.name}': verifiers environments are not available ({exc})") from None
        return module.build(cfg.name.removeprefix(VERIFIERS_PREFIX), cfg, reward)
    if ":" not in cfg.name:
        raise ConfigError(f"env.name '{cfg.name}' is not 'tools', 'guess', 'zoom', 'verifiers:<id>' nor 'pkg.module:factory'")
    from async_rl.config.loading import load_callable

    factory = load_callable("env.name", cfg.name)
    try:
        env = factory(cfg, reward)
    except Exception as exc:
        raise ConfigError(f"env.name '{cfg.name}': factory raised {type(exc).__name__}: {exc}") from None
    if not isinstance(env, Environment):
        raise ConfigError(f"env.name '{cfg.name}': factory returned {type(env).__name__}, not an async_rl Environment")
    return env


def _no_reward(sample: Sample) -> float:
    raise RuntimeError("the environment was built for its system prompt only: it scores nothing")


def environment_system_prompt(cfg: EnvConfig) -> str:
    """The configured environment's system-prompt text ('' for none)."""
    env = build_environment(cfg, _no_reward)
    return env.system_prompt() if env is not None else ""


def combined_system_prompt(base: str, cfg: EnvConfig) -> str:
    """data.system_prompt followed by the environment's text (a blank line between them)."""
    return "\n\n".join(part for part in (base, environment_system_prompt(cfg)) if part)
