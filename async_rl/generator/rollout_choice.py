"""Which rollout an engine runs, chosen once at its start from `env.name`: none -> single-turn
sampling; `agent:pkg.module:fn` or `verifiers:ID` (run as an agent) -> agent episodes; anything
else -> environment episodes. The kinds' own modules import their heavy parts (the tokenizer, the
agents' endpoint) only when chosen."""

from __future__ import annotations

from async_rl.config import EnvConfig
from async_rl.envs.factory import AGENT_PREFIX, VERIFIERS_PREFIX
from async_rl.generator.rewards import RewardRunner
from async_rl.generator.rollout import Rollout
from async_rl.serving.model import ServedModel
from async_rl.serving.sampling import SamplingSpec

AGENT_KINDS = (AGENT_PREFIX, VERIFIERS_PREFIX)  # verifiers:ID runs as an agent (envs/verifiers_env.py)


def make_rollout(
    model: ServedModel, env: EnvConfig, rewards: RewardRunner, engine_id: int, sampling: SamplingSpec, host: str
) -> Rollout:
    """`host`: the address an agent endpoint binds (its agents run on this node)."""
    if env.name.startswith(AGENT_KINDS):
        from async_rl.generator.agent_rollout import AgentRollout

        return AgentRollout(model, env, rewards, engine_id, sampling, host)
    if env.name:
        from transformers import AutoTokenizer

        from async_rl.envs.episode import ChatDelta
        from async_rl.generator.env_rollout import EnvironmentEpisodes

        # An environment turn's messages (and the next assistant header) as tokens; the model's turn
        # ends with the first of its stop tokens that the chat template ends an assistant turn with.
        if model.spec.images is not None:  # a vision-language model: its processor renders turns with images
            delta = vision_delta(model, sampling, env.name)
        else:
            tokenizer = AutoTokenizer.from_pretrained(model.spec.model_dir)
            delta = ChatDelta.for_model(tokenizer, sampling.stop_token_ids, f"env={env.name}")
        return EnvironmentEpisodes(model, env, delta, rewards, engine_id, sampling)
    from async_rl.generator.single_turn import SingleTurn

    return SingleTurn(model, rewards, engine_id, sampling)


def vision_delta(model: ServedModel, sampling: SamplingSpec, env_name: str):
    """A vision-language model's environment turns, rendered by its processor at the engine's pixel bounds."""
    from async_rl.config import VisionConfig
    from async_rl.envs.vision_delta import VisionChatDelta
    from async_rl.vision import VisionModel

    served = model.spec.images
    assert served is not None
    bounds = VisionConfig(**served.processor_kwargs)  # the run's vision.min_pixels/max_pixels
    return VisionChatDelta.for_vision(
        VisionModel(model.spec.model_dir, bounds), sampling.stop_token_ids, served.max_image_pixels, f"env={env_name}"
    )
