"""A teacher replica: a Ray actor that owns one served model (serving/model.py) with the teacher's
weights and serves `POST /v1/score` (the run's key, msgpack bodies: wire.py). A call scores one
group: each completion after the shared prompt, as vLLM's prompt log-probs over prompt + completion
(the log-prob of each completion token given everything before it, at temperature 1). The group's
completions go to vLLM as concurrent requests, and calls from every engine run at once: vLLM's
continuous batching batches them. Never trained, never weight-synced, never paused."""

from __future__ import annotations

import asyncio
import itertools

import msgspec
import numpy as np

from async_rl.protocol import LOGPROB_DTYPE
from async_rl.reward_models.served_replica import ServedModelReplica
from async_rl.reward_models.server import (
    ReplicaStats,
    RewardEndpoint,
    bearer_auth,
    bind_address,
    serve_app,
)
from async_rl.serving import vllm_compat as vc
from async_rl.serving.model import ServedModel
from async_rl.teacher.wire import TEACHER, ScoreReply, ScoreRequest, ids_of


class TeacherSettings(msgspec.Struct, frozen=True):
    replica_id: int
    spec: vc.EngineSpec
    model_name: str
    key: str
    threads: int  # vLLM's OpenMP threads (the replica is not pinned to cores)
    hang_s: float  # requests held this long with none answered: hung (0 = never)
    host: str = "127.0.0.1"  # the address the endpoint binds ('' = its node's IP: engines on other nodes)

    def __repr__(self) -> str:
        return f"TeacherSettings(replica {self.replica_id}, {self.spec.model_dir}, key <redacted>)"


async def score_group(model: ServedModel, prompt: list[int], completions: list[list[int]], tag: str) -> list[np.ndarray]:
    """The teacher's log-prob of every completion token given the prompt and the tokens before it."""

    async def one(i: int, completion: list[int]) -> np.ndarray:
        if not completion:
            return np.empty(0, LOGPROB_DTYPE)
        scores = await model.score_tokens(prompt + completion, f"{tag}-s{i}")
        return np.asarray(scores[len(prompt) :], dtype=LOGPROB_DTYPE)

    return list(await asyncio.gather(*(one(i, c) for i, c in enumerate(completions))))


class TeacherServer(ServedModelReplica):
    def __init__(self, settings: TeacherSettings) -> None:
        super().__init__(settings.spec, settings.threads, settings.hang_s)
        self.s = settings
        self._stats = ReplicaStats(settings.replica_id)
        self._calls = itertools.count()
        self._runner = None

    async def start(self) -> RewardEndpoint:
        from aiohttp import web

        s = self.s
        await self.start_model()
        app = web.Application(middlewares=[bearer_auth(s.key, self._refused)], client_max_size=256 << 20)
        app.router.add_post("/v1/score", self._score)
        host = bind_address(s.host)
        self._runner, port = await serve_app(app, host)
        return RewardEndpoint(TEACHER, s.replica_id, f"http://{host}:{port}/v1", s.key, s.model_name)

    def _refused(self) -> None:
        self._stats.refused += 1

    async def _score(self, request):
        from aiohttp import web

        def error(message: str, code: int):
            return web.json_response({"error": {"message": message, "code": code}}, status=code)

        try:
            req = msgspec.msgpack.decode(await request.read(), type=ScoreRequest)
            prompt = ids_of(req.prompt, "prompt")
            completions = [ids_of(c, f"completion {i}") for i, c in enumerate(req.completions)]
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            return error(f"bad request body: {exc}", 400)
        if not prompt:
            return error("the prompt is empty: the first token has no log-prob to score it by", 400)
        too_long = [i for i, c in enumerate(completions) if len(prompt) + len(c) > self.s.spec.max_model_len]
        if too_long:
            return error(f"completions {too_long} with the prompt exceed max_model_len {self.s.spec.max_model_len}", 400)
        try:
            scores = await score_group(self.model, prompt, completions, f"t{self.s.replica_id}-c{next(self._calls)}")
        except Exception as exc:  # the engine core died, or vLLM refused: the caller tries another replica
            return error(f"the teacher failed: {type(exc).__name__}: {exc}", 500)
        self._stats.requests += 1
        body = msgspec.msgpack.encode(ScoreReply([x.tobytes() for x in scores]))
        return web.Response(body=body, content_type="application/msgpack")

    def stats(self) -> ReplicaStats:
        return msgspec.structs.replace(self._stats)

    async def shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self.model.shutdown()
