"""An LLM judge replica: a Ray actor that owns one served model (serving/model.py) with the judge
model and serves it through the OpenAI-compatible endpoint layer (async_rl/endpoint/:
/v1/chat/completions, the run's key, bound to one address), each call on its own and recorded
nowhere, rendered by a chat renderer of its own. The judge is never trained and never
weight-synced: it holds the weights it was started with for the whole run."""

from __future__ import annotations

import msgspec

from async_rl.reward_models.served_replica import ServedModelReplica
from async_rl.reward_models.server import (
    JUDGE,
    ReplicaStats,
    RewardEndpoint,
    bind_address,
)
from async_rl.serving import vllm_compat as vc
from async_rl.serving.sampling import SamplingSpec


class JudgeSettings(msgspec.Struct, frozen=True):
    replica_id: int
    spec: vc.EngineSpec
    model_name: str  # what the endpoint's /v1/models names (and callers send as `model`)
    key: str
    threads: int  # vLLM's OpenMP threads (the replica is not pinned to cores)
    hang_s: float  # requests held this long with none answered: hung (0 = never)
    max_tokens: int  # a verdict's default length (callers send their own max_tokens)
    temperature: float
    host: str = "127.0.0.1"  # the address the endpoint binds ('' = its node's IP: reward workers on other nodes)

    def __repr__(self) -> str:
        return f"JudgeSettings(replica {self.replica_id}, {self.spec.model_dir}, key <redacted>)"


class JudgeEngine(ServedModelReplica):
    def __init__(self, settings: JudgeSettings) -> None:
        super().__init__(settings.spec, settings.threads, settings.hang_s)
        self.s = settings
        self._endpoint = None

    async def start(self) -> RewardEndpoint:
        from transformers import AutoTokenizer

        from async_rl.endpoint.endpoint import ChatEndpoint, ServedModelBackend
        from async_rl.endpoint.rendering import ChatRenderer
        from async_rl.serving.sampling import stop_token_ids

        s = self.s
        await self.start_model()
        stops = stop_token_ids(s.spec.model_dir)
        backend = ServedModelBackend(self.model, s.model_name, s.spec.max_model_len)
        renderer = ChatRenderer.for_model(AutoTokenizer.from_pretrained(s.spec.model_dir), stops, "the judge")
        defaults = SamplingSpec(n=1, max_tokens=s.max_tokens, temperature=s.temperature, stop_token_ids=stops)
        host = bind_address(s.host)
        self._endpoint = ChatEndpoint(backend, renderer, s.key, host, unrecorded=defaults)
        await self._endpoint.start()
        return RewardEndpoint(JUDGE, s.replica_id, f"http://{host}:{self._endpoint.port}/v1", s.key, s.model_name)

    def stats(self) -> ReplicaStats:
        e = self._endpoint
        return ReplicaStats(self.s.replica_id, requests=e.calls if e else 0, refused=e.refused if e else 0)

    async def shutdown(self) -> None:
        if self._endpoint is not None:
            await self._endpoint.stop()
        self.model.shutdown()
