"""The engine's side of the teacher: each finished group is scored by a teacher replica before the
engine pushes it (generator/engine.py). The call is asynchronous: the engine's other prompts keep
generating meanwhile, and only this group waits.

A call that fails or passes `teacher.timeout_s` is counted and tried again on the next replica, after
a short pause, until `teacher.max_wait_s` has passed since the group's first call: a dead replica's
restart (the supervisor's, which hands every engine the new address: `endpoints`) takes about as long
as the teacher's vLLM start. A group still unscored then is pushed without teacher log-probs and its
samples are counted (`unscored`): it trains on its task rewards only, nothing is dropped silently."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np

from async_rl.protocol import LOGPROB_DTYPE, TrajectoryGroup
from async_rl.reward_models.calls import post_body
from async_rl.reward_models.server import RewardEndpoint
from async_rl.teacher.wire import ScoreReply, ScoreRequest, TeacherCounts, ids_bytes, logprobs_of

RETRY_S = 1.0  # the pause before a failed group's next try (a restarting replica takes ~30 s on CPU)


class TeacherFailure(RuntimeError):
    """The teacher answered with an error, sent a malformed reply, or could not be reached."""


class TeacherScorer:
    def __init__(self, endpoints: list[RewardEndpoint], timeout_s: float, max_wait_s: float, first: int = 0) -> None:
        """`first`: where this engine starts its round-robin over the replicas (engines spread out)."""
        self.endpoints = list(endpoints)  # replaced when a dead replica is restarted at a new address
        self.timeout_s = timeout_s
        self.max_wait_s = max_wait_s
        self.counts = TeacherCounts()
        self.last_error = ""
        self._turn = first
        self._client = None

    def _pick(self) -> RewardEndpoint:
        if not self.endpoints:
            raise TeacherFailure("no teacher replica is running")
        self._turn += 1
        return self.endpoints[self._turn % len(self.endpoints)]

    async def score(self, group: TrajectoryGroup, rollout_s: float = 0.0) -> TrajectoryGroup:
        """`group` with its teacher log-probs (0.0 on environment tokens), or without them once
        `max_wait_s` has passed (counted as unscored). `rollout_s`: the time the group took before."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        body = msgspec.msgpack.encode(
            ScoreRequest(ids_bytes(group.prompt_tokens), [ids_bytes(c) for c in group.completions])
        )
        scores = None
        while scores is None:
            try:
                scores = await self._try(body, group)
            except TeacherFailure as exc:
                self.counts.failures += 1
                self.last_error = str(exc)
            except TimeoutError:
                self.counts.timeouts += 1
                self.last_error = f"no answer within teacher.timeout_s={self.timeout_s:g}"
            left = t0 + self.max_wait_s - loop.time()
            if scores is None and left <= 0:
                self.counts.unscored += group.size
                self._time(loop.time() - t0, rollout_s)
                return group
            if scores is None:
                await asyncio.sleep(min(RETRY_S, left))
        group.teacher_logprobs = [
            np.where(group.loss_mask(i) == 1, lp, 0.0).astype(LOGPROB_DTYPE) for i, lp in enumerate(scores)
        ]
        self.counts.groups += 1
        self.counts.samples += group.size
        self.counts.tokens += sum(len(c) for c in group.completions)
        self._time(loop.time() - t0, rollout_s)
        return group

    def _time(self, score_s: float, rollout_s: float) -> None:
        self.counts.score_s += score_s
        self.counts.rollout_s += rollout_s

    async def _try(self, body: bytes, group: TrajectoryGroup) -> list[np.ndarray]:
        endpoint = self._pick()
        raw = await asyncio.wait_for(self._post(endpoint, body), self.timeout_s)
        try:
            reply = msgspec.msgpack.decode(raw, type=ScoreReply)
            if len(reply.logprobs) != group.size:
                raise ValueError(f"{len(reply.logprobs)} score lists for {group.size} completions")
            return [
                logprobs_of(x, len(c), f"completion {i}")
                for i, (x, c) in enumerate(zip(reply.logprobs, group.completions, strict=True))
            ]
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            raise TeacherFailure(f"teacher replica {endpoint.replica_id}: bad reply: {exc}") from None

    async def _post(self, endpoint: RewardEndpoint, body: bytes) -> bytes:
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s)
        return await post_body(self._client, endpoint, "/score", body, "application/msgpack", TeacherFailure)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
