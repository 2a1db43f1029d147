"""What crosses the boundary between a reward-model replica (a Ray actor beside the generator pool)
and the rest of the run: its endpoint, its stats, and the one abstract class both replica kinds
(the LLM judge, the classifier) implement for the pool that starts, watches and restarts them."""

from __future__ import annotations

import abc
import asyncio
import hmac
from collections.abc import Callable

import msgspec

JUDGE = "judge"
CLASSIFIER = "classifier"
WATCH_POLL_S = 0.2  # how often a replica's pending watch call looks whether it still serves


class RewardEndpoint(msgspec.Struct, frozen=True):
    """Where a reward worker reaches one replica: an HTTP base URL guarded by the run's key
    (`Authorization: Bearer KEY`). The key travels on Ray's control plane, as the CURVE keys do."""

    kind: str  # JUDGE (OpenAI-compatible: base_url + '/chat/completions') | CLASSIFIER (base_url + '/classify')
    replica_id: int
    base_url: str  # 'http://HOST:PORT/v1'
    key: str
    model: str  # the served model's name (the judge's `model` field)

    def __repr__(self) -> str:  # the key must never land in a log line or a traceback
        return f"RewardEndpoint({self.kind} {self.replica_id} at {self.base_url}, key <redacted>)"


# The classifier's /v1/classify request and reply (the judge speaks OpenAI's chat completions).
class ClassifyInput(msgspec.Struct, frozen=True):
    question: str
    completion: str


class ClassifyRequest(msgspec.Struct, frozen=True):
    inputs: list[ClassifyInput]


class ClassifyReply(msgspec.Struct, frozen=True):
    scores: list[float]


class ReplicaStats(msgspec.Struct):
    """What one replica served (counted where it runs; the callers count outcomes: RewardModelCounts)."""

    replica_id: int
    requests: int = 0  # calls answered
    refused: int = 0  # calls without the run's key
    batches: int = 0  # classifier: forward passes
    max_batch: int = 0  # classifier: the largest batch scored in one pass


class ReplicaPids(msgspec.Struct, frozen=True):
    """Operating-system processes of one replica (tests kill them by pid)."""

    actor: int
    engine_core: list[int]  # the judge's vLLM processes under the actor (none for the classifier)


class RewardModelServer(abc.ABC):
    """One reward-model replica, a Ray actor: it serves its model over HTTP and is never trained."""

    @abc.abstractmethod
    async def start(self) -> RewardEndpoint:
        """Load the model and start serving; returns where to call it."""

    @abc.abstractmethod
    def healthy(self) -> bool:
        """False once the replica cannot serve any more (its vLLM engine core died)."""

    async def watch(self) -> str:
        """Returns (why) once the replica, having served, cannot any more; the controller keeps one
        call pending (death_watch.py), which Ray fails instead when the actor itself dies."""
        served = False
        while True:
            if self.healthy():
                served = True
            elif served:
                return "it stopped serving"
            await asyncio.sleep(WATCH_POLL_S)

    @abc.abstractmethod
    def stats(self) -> ReplicaStats: ...

    @abc.abstractmethod
    def pids(self) -> ReplicaPids: ...

    @abc.abstractmethod
    async def shutdown(self) -> None: ...


def bind_address(host: str) -> str:
    """A replica's settings name its address, or '' for the IP of the node it runs on."""
    if host:
        return host
    import ray

    return ray.util.get_node_ip_address()


def bearer_auth(key: str, on_refused: Callable[[], None]):
    """An aiohttp middleware that answers 401 (and calls `on_refused`) to a request without the run's
    key (`Authorization: Bearer KEY`), compared in constant time."""
    from aiohttp import web

    want = key.encode()

    @web.middleware
    async def auth(request, handler):
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.removeprefix("Bearer ").encode() if given.startswith("Bearer ") else b"", want):
            on_refused()
            return web.json_response({"error": {"message": "missing or wrong API key", "code": 401}}, status=401)
        return await handler(request)

    return auth


async def serve_app(app, host: str):
    """Serve the aiohttp `app` on `host` at a free port; returns (its runner, to clean up, and the port)."""
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]
