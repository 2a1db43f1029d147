"""`env.name: agent:pkg.module:fn` in a generator engine: one agent process per episode, talking to
the engine's own endpoint; the episode's recorded calls become its trajectories in the group.

A group holds `group_size` episodes sharing one prompt on the wire, but an agent renders its own
prompt (its system message, its tools). So the group's prompt is the longest common prefix of its
segments' prompts, and each sample's completion starts with the rest of its own prompt,
masked like environment tokens. What the learner sees is exactly what the model saw.

An episode whose calls split into several segments (prefix breaks) trains every segment: each is a
sample of the group, exactly what the model saw, carrying the episode's reward and its episode index
(`TrajectoryGroup.episode_of`), so the group's advantage statistics, the buffer's accounting and
the learner's sample counts stay per episode (docs/agents.md, 'Split episodes').
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import msgspec
import numpy as np

from async_rl.agents.runner import AgentJob, AgentOutcome, job_prompt, run_agent
from async_rl.config import EnvConfig
from async_rl.endpoint.endpoint import ChatEndpoint
from async_rl.endpoint.episode_log import Segment, build_segments
from async_rl.envs.factory import AGENT_PREFIX, VERIFIERS_PREFIX
from async_rl.protocol import (
    FINISH_REASONS,
    REWARD_CRASH,
    REWARD_ERROR,
    REWARD_OK,
    REWARD_TIMEOUT,
    TOKEN_DTYPE,
    ChatMessage,
    EpisodeInfo,
    Prompt,
    Sample,
    TrajectoryGroup,
    episode_versions,
    route_missing,
    route_rows,
)
from async_rl.serving.engine_routes import sequence_routes
from async_rl.serving.sampling import SamplingSpec, episode_sampling

# env.name 'verifiers:ID' runs this agent (under env.python, a venv with verifiers 0.4) with env_id=ID.
VERIFIERS_BRIDGE = "async_rl.agents.verifiers_bridge:run_episode"

AGENT_STATUS = {"ok": REWARD_OK, "error": REWARD_ERROR, "timeout": REWARD_TIMEOUT, "crash": REWARD_CRASH}

ScoreFn = Callable[[Sample], Awaitable[tuple[float, int]]]


class AgentCounters(msgspec.Struct):
    """Per engine, since its start."""

    episodes: int = 0
    calls: int = 0  # generation requests served to agents
    prefix_breaks: int = 0  # calls whose prompt did not extend their episode's tokens so far
    segments: int = 0  # trained sequences of the episodes: episodes with a call + prefix breaks
    errors: int = 0  # agents that raised (or returned something that is not a reward or messages)
    timeouts: int = 0  # agents killed at env.agent_timeout_s
    crashes: int = 0  # agent processes that died without a result
    refused: int = 0  # endpoint requests without the key
    last_error: str = ""


def common_prefix(seqs: list[list[int]]) -> list[int]:
    if not seqs:
        return []
    first = seqs[0]
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != first[i] for s in seqs[1:]):
            return first[:i]
    return first[:n]


class EpisodeOutcome(msgspec.Struct, kw_only=True):
    segments: list[Segment]  # every one trained, in call order (none: the agent made no call)
    reward: float
    status: int


class AgentEpisodes:
    """Runs a group's episodes through the agent and the endpoint, and assembles the group."""

    def __init__(self, cfg: EnvConfig, endpoint: ChatEndpoint, score: ScoreFn, engine_id: int) -> None:
        if cfg.name.startswith(VERIFIERS_PREFIX):  # a verifiers environment, run by the bridge agent
            self.target, self.env_id = VERIFIERS_BRIDGE, cfg.name.removeprefix(VERIFIERS_PREFIX)
        elif cfg.name.startswith(AGENT_PREFIX) and ":" in cfg.name.removeprefix(AGENT_PREFIX):
            self.target, self.env_id = cfg.name.removeprefix(AGENT_PREFIX), ""
        else:
            raise ValueError(f"env.name '{cfg.name}' is not 'agent:pkg.module:fn' nor 'verifiers:ID'")
        self.cfg = cfg
        self.endpoint = endpoint
        self.score = score
        self.engine_id = engine_id
        self.counters = AgentCounters()
        # Agent processes of this engine at once (train and eval episodes alike); the wait is outside
        # run_agent, so an episode's timeout counts from its own process's start.
        self._slots = asyncio.Semaphore(cfg.max_concurrent_agents) if cfg.max_concurrent_agents else None

    def stats(self) -> AgentCounters:
        return msgspec.structs.replace(self.counters, calls=self.endpoint.calls, refused=self.endpoint.refused)

    async def episode(self, prompt: Prompt, episode_id: str, sampling: SamplingSpec) -> EpisodeOutcome:
        messages = list(prompt.messages) or [ChatMessage("user", prompt.text)]
        job = AgentJob(
            target=self.target,
            base_url=self.endpoint.base_url(episode_id),
            api_key=self.endpoint.key,
            model=self.endpoint.backend.model_name,
            prompt=job_prompt(messages, list(prompt.images)),
            answer=prompt.answer,
            metadata=dict(prompt.metadata),
            timeout_s=self.cfg.agent_timeout_s,
            env_id=self.env_id,
        )
        async with self._slots or contextlib.nullcontext():  # the episode is open while its agent runs
            self.endpoint.open_episode(episode_id, sampling, self.cfg.max_turns)
            try:
                outcome = await run_agent(job, self.cfg.python)
            finally:
                log = self.endpoint.close_episode(episode_id)
        self.counters.episodes += 1
        segments = build_segments(log.calls)
        self.counters.prefix_breaks += max(0, len(segments) - 1)
        self.counters.segments += len(segments)
        reward, status = await self._reward(prompt, outcome)
        return EpisodeOutcome(segments=segments, reward=reward, status=status)

    async def _reward(self, prompt: Prompt, outcome: AgentOutcome) -> tuple[float, int]:
        if outcome.status != "ok":
            if outcome.status == "timeout":
                self.counters.timeouts += 1
            elif outcome.status == "crash":
                self.counters.crashes += 1
            else:
                self.counters.errors += 1
            self.counters.last_error = outcome.error
            return 0.0, AGENT_STATUS[outcome.status]
        if outcome.reward is not None:
            return outcome.reward, REWARD_OK
        answer = next((m.content for m in reversed(outcome.messages or []) if m.role == "assistant"), "")
        return await self.score(Sample(prompt=prompt, completion=answer))

    async def run_group(self, prompt: Prompt, request_id: str, sampling: SamplingSpec, n: int, version: int) -> TrajectoryGroup:
        """`n` agent episodes of `prompt` as one group (`version`: the engine's, for episodes without a call)."""
        outs = await asyncio.gather(
            *(self.episode(prompt, f"{request_id}-s{i}", episode_sampling(sampling, i)) for i in range(n))
        )
        trained = [s for o in outs for s in o.segments]
        if not trained:
            raise RuntimeError(f"prompt {prompt.prompt_id}: no agent episode made a model call ({self.counters.last_error})")
        # Every sample of the group really starts with the group's prompt: the common prefix of all
        # segments (a segment after a prefix break may share less of it than the first ones).
        head = common_prefix([s.prompt_ids for s in trained])
        if not head:
            raise RuntimeError(f"prompt {prompt.prompt_id}: the agent episodes' prompts share no first token")
        rows: list[tuple[int, EpisodeOutcome, Segment]] = []
        for e, o in enumerate(outs):
            # The agent failed before its first call: an empty sample, its status counted.
            empty = Segment(prompt_ids=list(head), turn_versions=[], version_last=version, finish_reason="abort")
            rows += [(e, o, s) for s in (o.segments or [empty])]
        completions, masks, logprobs, episodes, firsts, lasts, finishes = [], [], [], [], [], [], []
        for _, _, s in rows:
            rest = s.prompt_ids[len(head) :]
            completions.append(np.asarray(rest + s.completion_ids, dtype=TOKEN_DTYPE))
            masks.append(np.asarray([0] * len(rest) + s.loss_mask, dtype=np.uint8))
            logprobs.append(np.asarray([0.0] * len(rest) + s.logprobs, dtype=np.float32))
            episodes.append(EpisodeInfo(turns=len(s.turn_versions), turn_versions=list(s.turn_versions)))
            first, last = episode_versions(s.turn_versions, s.version_last) if s.turn_versions else (version, s.version_last)
            firsts.append(first)
            lasts.append(last)
            finishes.append(FINISH_REASONS.get(s.finish_reason, FINISH_REASONS["stop"]))
        split = len(rows) > len(outs)
        return TrajectoryGroup(
            prompt_id=prompt.prompt_id,
            engine_id=self.engine_id,
            prompt_tokens=np.asarray(head, dtype=TOKEN_DTYPE),
            completions=completions,
            logprobs=logprobs,
            rewards=[o.reward for _, o, _ in rows],
            version_first=firsts,
            version_last=lasts,
            reward_status=[o.status for _, o, _ in rows],
            finish_reasons=finishes,
            loss_masks=masks,
            episodes=episodes,
            episode_of=[e for e, _, _ in rows] if split else None,
            routes=segment_routes([s for _, _, s in rows]),
            # a vision-language model's: every image a segment holds is its own (the group's prompt is
            # the segments' common prefix, whose images the samples carry each)
            sample_images=[list(s.images) for _, _, s in rows] if any(s.images for _, _, s in rows) else None,
        )


def segment_routes(segments: list[Segment]) -> list[np.ndarray] | None:
    """Each trained segment's MoE routes over its whole sequence, from its calls' routes (None when no
    call recorded any: capture off, a dense model). A segment without a model call (an agent that failed
    first) gets all rows ROUTE_MISSING, so the group still carries routes for the others."""
    routes = [sequence_routes(s.tokens(), s.turn_routes) for s in segments]
    some = next((r for r in routes if r is not None), None)
    if some is None:
        return None
    missing = route_missing(some.dtype)
    return [
        r if r is not None else np.full((route_rows(len(s.tokens()), 0), *some.shape[1:]), missing, some.dtype)
        for r, s in zip(routes, segments, strict=True)
    ]
