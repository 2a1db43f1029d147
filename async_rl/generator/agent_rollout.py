"""Agent episodes (`env.name: agent:pkg.module:fn` or `verifiers:ID`): one agent process per episode
talks to this engine's own OpenAI-compatible endpoint over its served model; the episode's recorded
calls become its trajectories in the group (agents/episodes.py)."""

from __future__ import annotations

import secrets

from async_rl.agents.episodes import AgentEpisodes
from async_rl.config import EnvConfig
from async_rl.endpoint.endpoint import ChatEndpoint, ServedModelBackend
from async_rl.endpoint.rendering import ChatRenderer
from async_rl.evaluation.scores import EvalParams, EvalResult
from async_rl.generator.rewards import RewardRunner
from async_rl.generator.rollout import AGENT, Rollout, RolloutCounters, episodes_result, eval_sampling
from async_rl.protocol import Prompt, TrajectoryGroup
from async_rl.serving.model import ServedModel
from async_rl.serving.sampling import SamplingSpec


class AgentRollout(Rollout):
    def __init__(
        self,
        model: ServedModel,
        cfg: EnvConfig,
        rewards: RewardRunner,
        engine_id: int,
        sampling: SamplingSpec,
        host: str,
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.rewards = rewards
        self.engine_id = engine_id
        self.sampling = sampling
        self.host = host
        self.episodes: AgentEpisodes | None = None

    async def start(self) -> None:
        """Bind the endpoint (a fresh key per engine and run: only this engine's own agent processes
        are handed it)."""
        from transformers import AutoTokenizer

        spec = self.model.spec
        max_len = min(spec.max_model_len, self.cfg.max_total_tokens or spec.max_model_len)
        stops = self.sampling.stop_token_ids
        if spec.images is not None:  # a vision-language model: requests' image parts rendered by its processor
            from async_rl.config import VisionConfig
            from async_rl.vision import VisionModel

            vision = VisionModel(spec.model_dir, VisionConfig(**spec.images.processor_kwargs))
            renderer = ChatRenderer.for_model(vision.processor.tokenizer, stops, "env=agent", vision, spec.images.max_image_pixels)
        else:
            renderer = ChatRenderer.for_model(AutoTokenizer.from_pretrained(spec.model_dir), stops, "env=agent")
        backend = ServedModelBackend(self.model, spec.model_dir, max_len)
        max_images = spec.images.max_images if spec.images is not None else 0
        endpoint = ChatEndpoint(backend, renderer, secrets.token_urlsafe(32), self.host, max_images=max_images)
        await endpoint.start()
        self.episodes = AgentEpisodes(self.cfg, endpoint, self.rewards.score, self.engine_id)

    def _started(self) -> AgentEpisodes:
        if self.episodes is None:
            raise RuntimeError("agent episodes before the engine's endpoint started")
        return self.episodes

    async def group(self, prompt: Prompt, request_id: str, sampling: SamplingSpec, n: int) -> TrajectoryGroup:
        # the served version: what an episode without a model call records
        return await self._started().run_group(prompt, request_id, sampling, n, self.model.version)

    async def evaluate(self, prompt: Prompt, params: EvalParams, request_id: str) -> EvalResult:
        """`params.n` whole agent episodes of `prompt`."""
        return episodes_result(prompt, await self.group(prompt, request_id, eval_sampling(self.sampling, params, 1), params.n))

    def counters(self) -> RolloutCounters:
        agents = self.episodes.stats() if self.episodes is not None else None
        return RolloutCounters(kind=AGENT, episodes=agents.episodes if agents else 0, agents=agents)

    async def close(self) -> None:
        if self.episodes is not None:
            await self.episodes.endpoint.stop()
