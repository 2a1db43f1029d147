"""Environment episodes (`env.name` a built-in or `pkg.module:factory`): each prompt's group is `n`
multi-turn episodes (`envs/episode.py`). Every model turn is one request from the running token ids,
started only while the served model runs (a turn waits out a pause before it starts); a turn cut by
an abort-mode pause is resubmitted from where it stopped like a single-turn completion (its rest
comes from the new weights), so an episode survives every pause mode. The episode's final reward
goes through the reward worker processes.

A vision-language model's episode sends every turn with all its images so far (the prompt's, then the
environment's: `EpisodeImages`), and each sample carries the environment's images to the learner."""

from __future__ import annotations

import asyncio
import contextvars

import msgspec
import numpy as np

from async_rl.config import EnvConfig
from async_rl.envs.base import Environment
from async_rl.envs.episode import ChatDelta, EpisodeImages, EpisodeResult, ModelTurn, run_episode
from async_rl.envs.tool_env import RewardFn
from async_rl.evaluation.scores import EvalParams, EvalResult
from async_rl.generator.rewards import RewardRunner
from async_rl.generator.rollout import (
    ENVIRONMENT,
    EPISODE_FINISH,
    Rollout,
    RolloutCounters,
    episodes_result,
    eval_sampling,
)
from async_rl.protocol import (
    REWARD_OK,
    TOKEN_DTYPE,
    ChatMessage,
    EpisodeInfo,
    Prompt,
    Sample,
    TrajectoryGroup,
    episode_versions,
)
from async_rl.serving import vllm_compat as vc
from async_rl.serving.engine_routes import sequence_routes
from async_rl.serving.model import ServedModel
from async_rl.serving.sampling import SamplingSpec, episode_sampling, turn_sampling

# The reward status of the episode the current task runs (each episode runs in its own task).
_episode_reward_status: contextvars.ContextVar[list[int]] = contextvars.ContextVar("episode_reward_status")


class EnvironmentEpisodes(Rollout):
    def __init__(
        self,
        model: ServedModel,
        cfg: EnvConfig,
        delta: ChatDelta,
        rewards: RewardRunner,
        engine_id: int,
        sampling: SamplingSpec,
        reward: RewardFn | None = None,
    ) -> None:
        """`delta` renders the environment's turns; `reward` (default: the task's reward in the
        reward workers, its status kept per episode) scores a finished episode."""
        from async_rl.envs.factory import build_environment

        self.model = model
        self.cfg = cfg
        self.delta = delta
        self.rewards = rewards
        self.engine_id = engine_id
        self.sampling = sampling
        self.env: Environment = build_environment(cfg, reward or self._worker_reward)
        self._counters = RolloutCounters(kind=ENVIRONMENT)

    async def _worker_reward(self, sample: Sample) -> float:
        """The task's reward in the reward worker processes; its status (timeout, crash) is kept for
        the episode being run."""
        value, status = await self.rewards.score(sample)
        holder = _episode_reward_status.get(None)
        if holder is not None:
            holder[0] = status
        return value

    def counters(self) -> RolloutCounters:
        return msgspec.structs.replace(self._counters)

    async def group(self, prompt: Prompt, request_id: str, sampling: SamplingSpec, n: int) -> TrajectoryGroup:
        """`n` episodes of `prompt` as one group; each model turn samples with `sampling` (its
        max_tokens bounds a turn)."""
        if not prompt.token_ids:
            raise RuntimeError(f"prompt {prompt.prompt_id}: an episode needs the rendered prompt tokens")
        messages = list(prompt.messages) or [ChatMessage("user", prompt.text)]
        limit = self.cfg.max_total_tokens or self.model.spec.max_model_len
        runs = await asyncio.gather(
            *(self._episode(prompt, messages, limit, f"{request_id}-s{i}", episode_sampling(sampling, i)) for i in range(n))
        )
        results = [r for r, _, _, _ in runs]
        if any(not r.turn_versions for r in results):
            raise RuntimeError(
                f"prompt {prompt.prompt_id}: its {len(prompt.token_ids)} tokens leave no room for a model turn "
                f"under env.max_total_tokens={limit}"
            )
        versions = [episode_versions(r.turn_versions, last) for r, last, _, _ in runs]
        routes = [rt for _, _, _, rt in runs]
        return TrajectoryGroup(
            prompt_id=prompt.prompt_id,
            engine_id=self.engine_id,
            prompt_tokens=np.asarray(prompt.token_ids, dtype=TOKEN_DTYPE),
            completions=[np.asarray(r.completion_ids, dtype=TOKEN_DTYPE) for r in results],
            logprobs=[np.asarray(r.logprobs, dtype=np.float32) for r in results],
            rewards=[r.reward for r in results],
            version_first=[first for first, _ in versions],
            version_last=[last for _, last in versions],
            reward_status=[st for _, _, st, _ in runs],
            finish_reasons=[EPISODE_FINISH[r.finish_reason] for r in results],
            loss_masks=[np.asarray(r.loss_mask, dtype=np.uint8) for r in results],
            episodes=[
                EpisodeInfo(
                    turns=r.turns,
                    tool_calls=r.tool_calls,
                    tool_errors=r.tool_errors,
                    tool_timeouts=r.tool_outcomes.get("timeout", 0),
                    tool_ok=r.tool_outcomes.get("ok", 0),
                    turn_versions=list(r.turn_versions),
                )
                for r in results
            ],
            routes=routes if all(r is not None for r in routes) else None,
            images=list(prompt.images) or None,
            sample_images=[list(r.images) for r in results] if any(r.images for r in results) else None,
        )

    async def _episode(
        self, prompt: Prompt, messages: list[ChatMessage], limit: int, request_id: str, sampling: SamplingSpec
    ) -> tuple[EpisodeResult, int, int, np.ndarray | None]:
        """One episode: (result, policy version when its last model turn ended, reward status, its routes
        with capture on)."""
        status = [REWARD_OK]
        _episode_reward_status.set(status)  # this coroutine runs in its own task: its own context
        last_version = [self.model.version]
        turns = [0]
        turn_routes: list[tuple[list[int], np.ndarray]] = []  # per model turn: its input ids, its rows
        served = self.model.spec.images  # a vision-language model: every turn goes with the images so far
        images = None
        if served is not None:
            images = EpisodeImages(served.image_token_id, len(prompt.token_ids), served.max_images - len(prompt.images))

        async def generate(ids: list[int], budget: int) -> ModelTurn:
            turns[0] += 1
            self._counters.model_turns += 1
            turn = msgspec.structs.replace(sampling, n=1, max_tokens=min(sampling.max_tokens, budget))
            params = vc.params_for(turn_sampling(turn, turns[0]))
            shown = list(prompt.images) + (images.images if images is not None else [])
            # starts only while the model runs (not in the middle of a weight update)
            out = await self.model.generate(
                ids, params, f"{request_id}-t{turns[0]}", "", shown, images.span if images is not None else 0
            )
            if shown and out.prompt_ids != ids:
                # vLLM expanded an image to another token count than the processor here (vision.* bounds)
                raise RuntimeError(f"prompt {prompt.prompt_id}: vLLM generated turn {turns[0]} from other tokens than the episode's")
            last_version[0] = out.version_last
            (c,) = out.completions
            if c.routes is not None:
                turn_routes.append((ids, c.routes))
            return ModelTurn(c.token_ids, c.logprobs, c.text, c.finish_reason, out.version_first)

        self._counters.episodes += 1
        result = await run_episode(
            self.env.start(prompt), list(prompt.token_ids), messages, generate, self.delta, self.cfg.max_turns, limit,
            images,
        )
        routes = None
        if self.model.spec.routes is not None:
            routes = sequence_routes(list(prompt.token_ids) + list(result.completion_ids), turn_routes)
        return result, last_version[0], status[0], routes

    async def evaluate(self, prompt: Prompt, params: EvalParams, request_id: str) -> EvalResult:
        """`params.n` whole episodes of `prompt` in the environment."""
        return episodes_result(prompt, await self.group(prompt, request_id, eval_sampling(self.sampling, params, 1), params.n))

