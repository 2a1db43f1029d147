"""Builds an engine's agent machinery at its start: the endpoint (bound, keyed) and AgentEpisodes."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from async_rl.agents.endpoint import AgentEndpoint
from async_rl.agents.episodes import AgentEpisodes, EngineModel
from async_rl.agents.rendering import ChatRenderer

if TYPE_CHECKING:
    from async_rl.generator.engine import EngineSettings, GeneratorEngine


def end_of_turn_renderer(tokenizer, stop_ids: list[int]) -> ChatRenderer:
    """A renderer whose end-of-turn token is the first of the model's stop tokens that its chat
    template ends an assistant turn with (as the built-in environments pick it)."""
    errors = []
    for token in stop_ids:
        try:
            return ChatRenderer(tokenizer, token)
        except ValueError as exc:
            errors.append(str(exc))
    raise RuntimeError(f"env=agent: cannot render chat turns: {'; '.join(errors) or 'the model has no stop token'}")


async def start_agents(engine: GeneratorEngine, s: EngineSettings) -> AgentEpisodes:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(s.spec.model_dir)
    max_len = min(s.spec.max_model_len, s.env.max_total_tokens or s.spec.max_model_len)
    backend = EngineModel(engine._llm, engine._running, lambda: engine.version, s.spec.model_dir, max_len)
    # A fresh key per engine and run: only this engine's own agent processes are handed it.
    endpoint = AgentEndpoint(backend, end_of_turn_renderer(tokenizer, engine.sampling.stop_token_ids),
                             secrets.token_urlsafe(32), s.endpoint_host)
    await endpoint.start()
    return AgentEpisodes(s.env, endpoint, engine.rewards.score, s.engine_id)
