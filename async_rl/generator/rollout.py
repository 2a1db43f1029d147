"""The rollout interface: what a generator engine does with one leased prompt. Three kinds implement
it, and the engine chooses one at start (`rollout_choice.make_rollout`): single-turn sampling
(`single_turn.py`), environment episodes (`env_rollout.py`) and agent episodes (`agent_rollout.py`).
Each turns a prompt into a scored group for the buffer, evaluates a prompt without training on it,
and counts what its kind counts (`RolloutCounters`, summed into the step record)."""

from __future__ import annotations

import abc

import msgspec

from async_rl.agents.episodes import AgentCounters
from async_rl.evaluation.scores import EvalParams, EvalResult
from async_rl.protocol import FINISH_LENGTH, FINISH_REASONS, FINISH_STOP, REWARD_OK, Prompt, TrajectoryGroup
from async_rl.serving.sampling import SamplingSpec

SINGLE_TURN, ENVIRONMENT, AGENT = "single-turn", "environment", "agent"

# An episode's finish -> the wire's: the environment ended it or its turns ran out ('stop'), the
# token budget cut it ('length'), a turn was aborted and not resumed ('abort'); an environment turn's
# images could not be shown ('max_images', 'placeholder_sampled': `envs/episode.EpisodeImages`).
EPISODE_FINISH = {
    "stop": FINISH_STOP, "max_turns": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_REASONS["abort"],
    "max_images": FINISH_STOP, "placeholder_sampled": FINISH_STOP,
}


def finish_code(reason: str, prompt_id: int) -> int:
    """vLLM's finish reason -> its wire code. Another reason (vLLM's 'error') fails the request, which
    the buffer counts as lost, instead of passing for a clean stop."""
    if reason not in FINISH_REASONS:
        raise RuntimeError(f"prompt {prompt_id}: vLLM finished a completion with reason {reason!r}")
    return FINISH_REASONS[reason]


class RolloutCounters(msgspec.Struct):
    """What one engine's rollouts did since its start, by the kind that ran them."""

    kind: str  # SINGLE_TURN | ENVIRONMENT | AGENT
    episodes: int = 0  # environment and agent episodes run (training and evaluation)
    model_turns: int = 0  # environment episodes' model turns (agents: their calls, in `agents`)
    agents: AgentCounters | None = None  # agent episodes: calls, prefix breaks, segments, failures by kind


class Rollout(abc.ABC):
    """One kind of rollout over the engine's served model; the engine holds exactly one."""

    async def start(self) -> None:  # noqa: B027 (a kind with nothing to start keeps this)
        """Start what the kind needs beside the served model (the agents' endpoint)."""

    @abc.abstractmethod
    async def group(self, prompt: Prompt, request_id: str, sampling: SamplingSpec, n: int) -> TrajectoryGroup:
        """`n` scored samples (or episodes) of `prompt`, as one group for the buffer."""

    @abc.abstractmethod
    async def evaluate(self, prompt: Prompt, params: EvalParams, request_id: str) -> EvalResult:
        """`params.n` scored samples (or episodes) of `prompt`, with the eval's sampling."""

    @abc.abstractmethod
    def counters(self) -> RolloutCounters: ...

    async def close(self) -> None:  # noqa: B027
        """Stop what `start` started."""


def episodes_result(prompt: Prompt, group: TrajectoryGroup) -> EvalResult:
    """An evaluation of whole episodes: each episode's reward; its length counts every completion
    token, the environment's too (a split agent episode: its last segment)."""
    last = group.episode_last_samples()
    return EvalResult(
        prompt_id=prompt.prompt_id,
        data_source=prompt.data_source,
        rewards=[group.rewards[i] for i in last],
        completion_lens=[len(group.completions[i]) for i in last],
        finish_reasons=[group.finish_reasons[i] for i in last] if group.finish_reasons else [],
        reward_failures=sum(1 for i in last if group.reward_status[i] != REWARD_OK),
    )


def eval_sampling(base: SamplingSpec, params: EvalParams, n: int) -> SamplingSpec:
    """The training sampler's stop tokens and strings with the eval's temperature and length."""
    return msgspec.structs.replace(
        base, n=n, temperature=params.temperature, max_tokens=params.max_tokens, seed=params.seed
    )
