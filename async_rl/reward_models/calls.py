"""What runs in a reward worker when task.reward names a reward model: one call per sample to a
replica (the judge's /v1/chat/completions through the openai SDK, the classifier's /v1/classify),
with a timeout of its own, and an outcome the engine counts (`RewardModelCounts`).

A call that fails or times out raises (`RewardModelFailure`, `RewardModelTimeout`): the sample is a
reward error (reward 0, counted in the reward counters and here). A judge reply without a verdict is
not an error: the sample gets `task.judge.unparseable_reward`, counted as unparseable. The replicas'
endpoints are handed to every call by the engine (they change when a dead replica is restarted)."""

from __future__ import annotations

import abc
import asyncio
import os

import msgspec

from async_rl.config import ClassifierConfig, JudgeConfig
from async_rl.protocol import Prompt, Sample
from async_rl.reward_models.server import ClassifyInput, ClassifyReply, ClassifyRequest, RewardEndpoint
from async_rl.reward_models.verdicts import parse_verdict, render_judge_prompt

OK = "ok"
UNPARSEABLE = "unparseable"


class RewardModelFailure(RuntimeError):
    """The reward model answered with an error, or could not be reached."""


class RewardModelTimeout(RuntimeError):
    """The reward model did not answer within its timeout_s."""


class RewardModelCounts(msgspec.Struct):
    """Reward-model calls of one engine's reward workers, by outcome."""

    calls: int = 0
    ok: int = 0
    unparseable: int = 0  # the judge's reply held no verdict (the sample got unparseable_reward)
    failures: int = 0  # an error answer or no connection (a reward error)
    timeouts: int = 0  # past timeout_s (a reward error)

    def add(self, other: RewardModelCounts) -> None:
        for field in self.__struct_fields__:
            setattr(self, field, getattr(self, field) + getattr(other, field))


def question_text(prompt: Prompt) -> str:
    """The question as a reward model reads it: the prompt's last user message, or its text."""
    for message in reversed(prompt.messages):
        if message.role == "user":
            return message.content
    return prompt.text


class RewardModelCall(abc.ABC):
    """A reward model's score of one sample, called from a reward worker process."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._turn = os.getpid()  # workers start their round-robin over the replicas at different places

    def pick(self, endpoints: list[RewardEndpoint]) -> RewardEndpoint:
        if not endpoints:
            raise RewardModelFailure("no reward-model replica is running")
        self._turn += 1
        return endpoints[self._turn % len(endpoints)]

    async def score(self, sample: Sample, endpoints: list[RewardEndpoint]) -> tuple[float, str]:
        """(reward, OK or UNPARSEABLE); raises RewardModelFailure or RewardModelTimeout."""
        endpoint = self.pick(endpoints)
        self._connect(endpoint)  # outside the timeout: a first client builds its SSL context (~1 s on 2 busy cores)
        try:
            return await asyncio.wait_for(self._call(endpoint, sample), self.timeout_s)
        except TimeoutError:
            raise RewardModelTimeout(
                f"{endpoint.kind} replica {endpoint.replica_id}: no answer within {self.timeout_s:g} s"
            ) from None

    @abc.abstractmethod
    def _connect(self, endpoint: RewardEndpoint) -> None:
        """Make (once) the HTTP client `_call` uses for `endpoint`."""

    @abc.abstractmethod
    async def _call(self, endpoint: RewardEndpoint, sample: Sample) -> tuple[float, str]: ...


class JudgeCall(RewardModelCall):
    """The judge reads the rendered template (and the system prompt) and writes a verdict."""

    def __init__(self, cfg: JudgeConfig) -> None:
        super().__init__(cfg.timeout_s)
        self.cfg = cfg
        self._clients: dict[str, object] = {}  # an openai client per replica, kept for the worker's life

    def messages(self, sample: Sample) -> list[dict[str, str]]:
        user = render_judge_prompt(self.cfg.prompt_template(), question_text(sample.prompt), sample.completion, sample.prompt.answer)
        system = [{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else []
        return [*system, {"role": "user", "content": user}]

    def _connect(self, endpoint: RewardEndpoint) -> None:
        import openai

        if endpoint.base_url not in self._clients:
            self._clients[endpoint.base_url] = openai.AsyncOpenAI(
                base_url=endpoint.base_url, api_key=endpoint.key, max_retries=0, timeout=self.timeout_s
            )

    async def _call(self, endpoint: RewardEndpoint, sample: Sample) -> tuple[float, str]:
        import openai

        client = self._clients[endpoint.base_url]
        try:
            reply = await client.chat.completions.create(
                model=endpoint.model, messages=self.messages(sample), max_tokens=self.cfg.max_tokens,
                temperature=self.cfg.temperature,
            )
        except openai.APITimeoutError:
            raise TimeoutError from None
        except openai.APIError as exc:
            raise RewardModelFailure(f"judge replica {endpoint.replica_id}: {type(exc).__name__}: {exc}") from None
        verdict = parse_verdict(reply.choices[0].message.content or "", self.cfg.verdict, self.cfg.score_max)
        if verdict is None:
            return self.cfg.unparseable_reward, UNPARSEABLE
        return verdict, OK


class ClassifierCall(RewardModelCall):
    """The classifier replica scores (question, completion); its score is the reward."""

    def __init__(self, cfg: ClassifierConfig) -> None:
        super().__init__(cfg.timeout_s)
        self._client = None

    def _connect(self, endpoint: RewardEndpoint) -> None:
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s)

    async def _call(self, endpoint: RewardEndpoint, sample: Sample) -> tuple[float, str]:
        body = msgspec.json.encode(ClassifyRequest([ClassifyInput(question_text(sample.prompt), sample.completion)]))
        raw = await post_body(self._client, endpoint, "/classify", body, "application/json", RewardModelFailure)
        (value,) = msgspec.json.decode(raw, type=ClassifyReply).scores
        return value, OK


async def post_body(client, endpoint: RewardEndpoint, path: str, body: bytes, content_type: str,
                    failure: type[Exception]) -> bytes:
    """POST `body` to a replica's `path` with the run's key through an httpx client; the reply's body.
    Raises TimeoutError past the client's timeout and `failure` (one line naming the replica) for no
    connection or an answer other than 200."""
    import httpx

    try:
        response = await client.post(
            endpoint.base_url + path, content=body,
            headers={"Authorization": f"Bearer {endpoint.key}", "Content-Type": content_type},
        )
    except httpx.TimeoutException:
        raise TimeoutError from None
    except httpx.HTTPError as exc:
        raise failure(f"{endpoint.kind} replica {endpoint.replica_id}: {type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        raise failure(f"{endpoint.kind} replica {endpoint.replica_id}: HTTP {response.status_code}: {response.text[:200]}")
    return response.content
