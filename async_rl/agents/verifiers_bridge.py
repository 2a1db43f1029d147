"""`env.name: verifiers:ID` as an agent: one episode of a verifiers 0.4 environment per call, run in
the verifiers venv (`env.python`) against the episode's route of the engine's OpenAI endpoint.

Imported only by `agent_main.py` under `env.python`: standard library, `verifiers` and what it brings
(pydantic, openai 2.x); nothing of async_rl beyond this file. The environment is verifiers' own:
`utils.loaders.resolve_env_config` + `load_environment` resolve ID to an installed taskset package
(a bare module name, `pkg.module`, or `owner/name` of which verifiers keeps `name`), its Env class
(`SingleAgentEnv` unless the package exports one) and its default harness (the package's, else
`bash`); `Env.run_episode(task, ModelContext(model, EvalClientConfig(base_url=...)))` runs it. Every
agent seat runs in verifiers' `subprocess` runtime (the engine's node; no container); its harness
program (a PEP 723 script) is prepared by `uv`, which must be on PATH: this venv's `bin` is put first.

The task is built from our prompt: the taskset's TaskData type gets `prompt` (the chat messages),
`answer` (the prompt's reference) and those of the prompt's metadata keys that it declares; a
prompt whose metadata has `vf_idx` instead takes the taskset's own task at that index. The reward is
the sum of the episode's traces' rewards (verifiers' `Trace.reward`: the weighted `@vf.reward`s).
A failed episode (an error in a harness, a task hook or the interception) raises, so the engine
counts it as an agent error with verifiers' own message.
"""

from __future__ import annotations

import os
import sys

ENDPOINT_KEY_VAR = "ASYNC_RL_ENDPOINT_KEY"  # the env var verifiers' EvalClient reads the key from
TASK_INDEX_KEY = "vf_idx"  # prompt metadata: take the taskset's own task at this index


def env_config_data(env_id: str) -> dict:
    """verifiers' `[env]` config for ID: its taskset, every seat in the local subprocess runtime."""
    return {"taskset": {"id": env_id}}


def _with_subprocess_seats(config):
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.runtimes import SubprocessConfig

    seats = {name: seat.model_copy(update={"runtime": SubprocessConfig()}) for name, seat in agent_config_fields(config).items()}
    return config.model_copy(update=seats)


def build_task(env, prompt: list[dict], answer: str, metadata: dict):
    """The verifiers Task for our prompt (see the module doc)."""
    from verifiers.v1.task import TaskData
    from verifiers.v1.utils.generic import concrete_type

    taskset = env.taskset
    if TASK_INDEX_KEY in metadata:
        idx = int(metadata[TASK_INDEX_KEY])
        for task in taskset.include(idx=[f"{idx}:{idx + 1}"]):
            return task
        raise IndexError(f"the taskset of {env.config.env_id!r} has no task {TASK_INDEX_KEY}={idx}")
    task_cls = type(taskset).task_type()
    data_cls = concrete_type(task_cls, TaskData) or TaskData
    fields = {k: v for k, v in metadata.items() if k in data_cls.model_fields}
    fields["prompt"] = prompt
    if "answer" in data_cls.model_fields:
        fields["answer"] = answer
    return task_cls(data_cls.model_validate(fields), taskset.config.task)


def episode_reward(episode) -> float:
    """The episode's reward, or a RuntimeError with verifiers' first recorded error."""
    if not episode.ok:
        errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
        first = errors[0] if errors else None
        why = f"{first.type}: {first.message}" if first is not None else "no trace finished"
        raise RuntimeError(f"verifiers episode failed: {why}".splitlines()[0][:500])
    return float(sum(t.reward for t in episode.traces))


async def run_episode(client, prompt: list[dict], model: str, answer: str, metadata: dict, env_id: str) -> float:
    """The agent function the engine runs for `verifiers:<env_id>` (async: `client` is an AsyncOpenAI
    pointed at the episode's route; only its base_url and key are used)."""
    from verifiers.v1.clients import EvalClientConfig, ModelContext
    from verifiers.v1.utils.loaders import load_environment, resolve_env_config

    # verifiers' subprocess runtime prepares harness programs with `uv` (found on PATH).
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    os.environ[ENDPOINT_KEY_VAR] = client.api_key
    env = load_environment(_with_subprocess_seats(resolve_env_config(env_config_data(env_id))))
    task = build_task(env, prompt, answer, metadata)
    ctx = ModelContext(model=model, client=EvalClientConfig(base_url=str(client.base_url).rstrip("/"),
                                                            api_key_var=ENDPOINT_KEY_VAR))
    async with env.serving():
        episode = await env.run_episode(task, ctx)
    return episode_reward(episode)
