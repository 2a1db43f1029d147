"""The OpenAI-compatible endpoint of one served model (a generator engine's, or an LLM judge
replica's): /v1/chat/completions, /v1/completions, /v1/models, served on the owning actor's event
loop (aiohttp), bound to one host address and guarded by a key (`Authorization: Bearer KEY`;
anything else is a 401).

A request belongs to an episode by its route (`/episodes/{episode}/v1/...`) or by the
`X-Episode-Id` header; the engine opens an episode before its agent starts and closes it after.
Every call is recorded in the episode's `EpisodeLog` token in / token out. `/v1/models` needs no
episode; a generation request without a known episode is refused (404): what is not recorded
cannot be trained, and an unrecorded caller would only take generation time from the run.
An endpoint made with `unrecorded` sampling (the LLM judge's, reward_models/judge_engine.py) serves
calls without an episode too, each on its own, recorded nowhere: that model is never trained.
"""

from __future__ import annotations

import abc
import hmac
import itertools
import time
from collections.abc import Awaitable, Callable

import msgspec

from async_rl.endpoint.episode_log import CallRecord, Choice, EpisodeLog, Reply
from async_rl.endpoint.images import ImagePartError, request_images
from async_rl.endpoint.openai_types import ChatRequest, CompletionRequest
from async_rl.endpoint.rendering import ChatRenderer, parse_reply
from async_rl.endpoint.streaming import StreamFlags, chat_completion_chunks, sse_body
from async_rl.errors import first_line
from async_rl.images import ImageError
from async_rl.serving import vllm_compat as vc
from async_rl.serving.model import ServedModel
from async_rl.serving.sampling import SamplingSpec, turn_sampling

EPISODE_HEADER = "X-Episode-Id"


class CallSampling(msgspec.Struct, frozen=True, kw_only=True):
    """What one call asks for; None fields take the run's sampling settings."""

    n: int = 1
    max_tokens: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] = []


class CallImages(msgspec.Struct, frozen=True):
    """A vision-language call's images (encoded files, in the order of their placeholders) and its
    tokens up to the last image's placeholders (`PromptImages.span`)."""

    images: list[bytes]
    span: int


class ModelBackend(abc.ABC):
    """What the endpoint generates with: the engine's vLLM (one class per process boundary)."""

    model_name: str
    max_model_len: int  # prompt + completion tokens of one call at most

    @abc.abstractmethod
    async def complete(
        self, prompt_ids: list[int], base: SamplingSpec, call: CallSampling, request_id: str, images: CallImages | None = None
    ) -> list[Choice]:
        """Sample `call.n` completions of `prompt_ids` with `base` as changed by `call` (log-probs and
        policy versions recorded); `images`: the prompt's images."""


class ServedModelBackend(ModelBackend):
    """The endpoint's backend over a served model (the generator engine's, or a judge replica's).
    A call starts only while the model runs (not in the middle of a weight update) and records the
    versions it started and ended on."""

    def __init__(self, model: ServedModel, model_name: str, max_model_len: int) -> None:
        self.model = model
        self.model_name = model_name
        self.max_model_len = max_model_len

    async def complete(
        self, prompt_ids: list[int], base: SamplingSpec, call: CallSampling, request_id: str, images: CallImages | None = None
    ) -> list[Choice]:
        spec = msgspec.structs.replace(
            base,
            n=call.n,
            max_tokens=call.max_tokens,
            temperature=base.temperature if call.temperature is None else call.temperature,
            top_p=base.top_p if call.top_p is None else call.top_p,
            stop=list(base.stop) + [s for s in call.stop if s not in base.stop],
        )
        shown = images or CallImages([], 0)
        out = await self.model.generate(prompt_ids, vc.params_for(spec), request_id, "", shown.images, shown.span)
        if shown.images and out.prompt_ids != prompt_ids:
            # vLLM expanded an image to another token count than the endpoint's processor (vision.* bounds)
            raise RequestError(500, "vLLM generated from other tokens than the rendered prompt with its images", "server_error")
        return [Choice(token_ids=c.token_ids, logprobs=c.logprobs, text=c.text, finish_reason=c.finish_reason,
                       version_first=out.version_first, version_last=out.version_last, routes=c.routes)
                for c in out.completions]


class RequestError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def _last_index(ids: list[int], token: int) -> int:
    return len(ids) - 1 - ids[::-1].index(token)


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


class ChatEndpoint:
    def __init__(
        self,
        backend: ModelBackend,
        renderer: ChatRenderer,
        key: str,
        host: str = "127.0.0.1",
        unrecorded: SamplingSpec | None = None,
        max_images: int = 0,
    ) -> None:
        """`unrecorded`: serve calls that name no episode too, each on its own with these sampling
        defaults and recorded nowhere (a served model that is never trained: the LLM judge).
        `max_images`: most images one call may hold (a vision-language model's vision.max_images_per_prompt)."""
        if not key:
            raise ValueError("the endpoint needs a key")
        if host in ("0.0.0.0", "::", ""):
            raise ValueError(f"the endpoint binds one address of this node, not {host!r}")
        self.backend = backend
        self.renderer = renderer
        self.key = key  # handed to the episodes' agents
        self._key = key.encode()
        self.host = host
        self.unrecorded = unrecorded
        self.max_images = max_images
        self.port = 0
        self.episodes: dict[str, EpisodeLog] = {}
        self._ids = itertools.count()
        self._runner = None
        self.refused = 0  # requests without the key
        self.calls = 0

    # ---- lifecycle ---------------------------------------------------------------------------------

    async def start(self, port: int = 0) -> None:
        from aiohttp import web

        app = web.Application(middlewares=[self._auth], client_max_size=64 << 20)
        for prefix in ("/v1", "/episodes/{episode}/v1"):
            app.router.add_get(prefix + "/models", self._models)
            app.router.add_post(prefix + "/chat/completions", self._wrap(self._chat, streams=True))
            app.router.add_post(prefix + "/completions", self._wrap(self._completions))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def base_url(self, episode_id: str) -> str:
        """What an episode's OpenAI client is given (`base_url`): its own route."""
        return f"http://{self.host}:{self.port}/episodes/{episode_id}/v1"

    def open_episode(self, episode_id: str, sampling: SamplingSpec, max_calls: int) -> EpisodeLog:
        log = EpisodeLog(episode_id, sampling, max_calls)
        self.episodes[episode_id] = log
        return log

    def close_episode(self, episode_id: str) -> EpisodeLog:
        """The episode's log; later calls on its route are refused (404)."""
        return self.episodes.pop(episode_id)

    # ---- HTTP --------------------------------------------------------------------------------------

    def _error(self, status: int, message: str, kind: str = "invalid_request_error"):
        from aiohttp import web

        return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)

    @property
    def _auth(self):
        from aiohttp import web

        @web.middleware
        async def auth(request, handler):
            given = request.headers.get("Authorization", "")
            token = given.removeprefix("Bearer ").encode() if given.startswith("Bearer ") else b""
            if not hmac.compare_digest(token, self._key):
                self.refused += 1
                return self._error(401, "missing or wrong API key for this run's endpoint", "authentication_error")
            return await handler(request)

        return auth

    async def _models(self, request):
        from aiohttp import web

        return web.json_response(
            {"object": "list", "data": [{"id": self.backend.model_name, "object": "model", "owned_by": "async_rl",
                                         "max_model_len": self.backend.max_model_len}]}
        )

    def _wrap(self, handler: Callable[[EpisodeLog, bytes], Awaitable[dict]], streams: bool = False):
        """`streams`: a request with `stream: true` gets the reply as server-sent events (streaming.py)."""
        from aiohttp import web

        async def serve(request):
            episode = request.match_info.get("episode") or request.headers.get(EPISODE_HEADER, "")
            log = self.episodes.get(episode)
            if log is None and not episode and self.unrecorded is not None:
                log = EpisodeLog(f"call{next(self._ids)}", self.unrecorded, max_calls=1)  # dropped after the call
            if log is None:
                why = "no episode named" if not episode else f"episode '{episode}' is not open on this engine"
                return self._error(404, f"{why}: use the route /episodes/ID/v1 or the {EPISODE_HEADER} header")
            try:
                body = await request.read()
                reply = await handler(log, body)
                flags = msgspec.json.decode(body, type=StreamFlags) if streams else StreamFlags()
                if flags.stream:
                    events = sse_body(chat_completion_chunks(reply, flags.include_usage))
                    return web.Response(body=events, content_type="text/event-stream")
                return web.json_response(reply)
            except RequestError as exc:
                return self._error(exc.status, str(exc), exc.kind)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                return self._error(400, f"bad request body: {exc}")

        return serve

    # ---- generation --------------------------------------------------------------------------------

    def _sampling(
        self, log: EpisodeLog, n: int, max_tokens: int | None, prompt_len: int, temperature, top_p, stop
    ) -> CallSampling:
        if len(log.calls) >= log.max_calls:
            raise RequestError(429, f"episode '{log.episode_id}' made its {log.max_calls} calls (env.max_turns)")
        if n < 1:
            raise RequestError(400, f"n must be >= 1, got {n}")
        room = self.backend.max_model_len - prompt_len
        if room <= 0:
            raise RequestError(400, f"the prompt has {prompt_len} tokens; the model allows {self.backend.max_model_len}")
        want = max_tokens if max_tokens is not None else log.sampling.max_tokens
        if want < 1:
            raise RequestError(400, f"max_tokens must be >= 1, got {want}")
        return CallSampling(n=n, max_tokens=min(want, room), temperature=temperature, top_p=top_p, stop=_stop_list(stop))

    @staticmethod
    def _seeded(log: EpisodeLog) -> SamplingSpec:
        """The episode's sampler for its next call: with a seed (train.deterministic), one of the
        call's own, by its place in the episode (the agent's calls come one after another)."""
        return turn_sampling(log.sampling, len(log.calls) + 1)

    def _request_id(self, log: EpisodeLog) -> str:
        return f"{log.episode_id}-c{len(log.calls)}-{next(self._ids)}"

    async def _chat(self, log: EpisodeLog, body: bytes) -> dict:
        req = msgspec.json.decode(body, type=ChatRequest)
        if not req.messages:
            raise RequestError(400, "messages is empty")
        prompt_ids, images = self._render_chat(log, req)
        sampling = self._sampling(
            log, req.n, req.max_completion_tokens or req.max_tokens, len(prompt_ids), req.temperature, req.top_p, req.stop
        )
        rid = self._request_id(log)
        choices = await self.backend.complete(prompt_ids, self._seeded(log), sampling, rid, images)
        self.calls += 1
        use_tools = req.tools if req.tool_choice != "none" else None
        replies = [parse_reply(c.text, use_tools, f"call-{rid}-{j}") for j, c in enumerate(choices)]
        eot = self.renderer.end_of_turn_id
        log.record_chat(
            CallRecord(prompt_ids=prompt_ids, choices=choices, images=images.images if images else [],
                       images_span=images.span if images else 0),
            req.messages,
            req.tools,
            [Reply(content=r.content, tool_calls=r.tool_calls) for r in replies],
            [c.finish_reason == "stop" and bool(c.token_ids) and c.token_ids[-1] == eot for c in choices],
        )
        out_choices = []
        for j, (c, r) in enumerate(zip(choices, replies, strict=True)):
            message: dict = {"role": "assistant", "content": r.content}
            if r.tool_calls:
                message["tool_calls"] = [msgspec.to_builtins(t) for t in r.tool_calls]
            finish = "tool_calls" if r.tool_calls else c.finish_reason
            entry: dict = {"index": j, "message": message, "finish_reason": finish, "token_ids": c.token_ids}
            if req.logprobs:
                entry["logprobs"] = {"content": self._token_logprobs(c)}
            out_choices.append(entry)
        return self._envelope("chat.completion", rid, prompt_ids, choices, out_choices)

    def _render_chat(self, log: EpisodeLog, req: ChatRequest) -> tuple[list[int], CallImages | None]:
        """The call's prompt ids (spliced after the last call's reply when the messages extend it) and
        its images (None: none). A bad image part, or images for a text-only model: 400."""
        r = self.renderer
        try:
            images = request_images(req.messages, r.max_image_pixels)
        except ImagePartError as exc:
            raise RequestError(400, str(exc)) from None
        if images and r.vision is None:
            raise RequestError(400, f"the request holds {len(images)} image(s) but model '{self.backend.model_name}' has no vision tower")
        if len(images) > self.max_images:
            raise RequestError(400, f"the request holds {len(images)} images, more than vision.max_images_per_prompt={self.max_images}")
        spliced = log.splice(req.messages, req.tools)
        if spliced is not None and len(images) > len(log.calls[-1].images):
            last = log.calls[-1]  # the messages before the new ones hold its images
            if r.image_token_id in spliced[0][last.images_span:]:
                # vLLM gives images to placeholders in order: a placeholder the model sampled would take the
                # new image's place. Rendered whole instead (the reply's text has no such token): a new segment
                spliced = None
        try:
            if spliced is not None:
                head, _, start = spliced
                last = log.calls[-1]
                new = len(images) - len(last.images)
                delta = r.render_after_reply(req.messages[start:], images[len(last.images):])
                prompt_ids = head + delta
                span = last.images_span if not new else len(head) + _last_index(delta, r.image_token_id) + 1
            else:
                prompt_ids = r.render(req.messages, req.tools, images)
                span = _last_index(prompt_ids, r.image_token_id) + 1 if images else 0
        except (ValueError, ImageError) as exc:  # markers and images that disagree, a template that refuses them
            raise RequestError(400, f"messages: {first_line(exc)}") from None
        return prompt_ids, CallImages(images, span) if images else None

    async def _completions(self, log: EpisodeLog, body: bytes) -> dict:
        req = msgspec.json.decode(body, type=CompletionRequest)
        if req.stream:
            raise RequestError(400, "stream=true is not served: the endpoint answers whole completions")
        if isinstance(req.prompt, str):
            prompt_ids = list(self.renderer.tokenizer.encode(req.prompt))
        else:
            prompt_ids = list(req.prompt)
        if not prompt_ids:
            raise RequestError(400, "prompt is empty")
        sampling = self._sampling(log, req.n, req.max_tokens, len(prompt_ids), req.temperature, req.top_p, req.stop)
        rid = self._request_id(log)
        choices = await self.backend.complete(prompt_ids, self._seeded(log), sampling, rid)
        self.calls += 1
        log.record_completion(CallRecord(prompt_ids=prompt_ids, choices=choices))
        out_choices = []
        for j, c in enumerate(choices):
            entry: dict = {"index": j, "text": c.text, "finish_reason": c.finish_reason, "token_ids": c.token_ids}
            if req.logprobs is not None:
                tokens = self.renderer.tokenizer.convert_ids_to_tokens(c.token_ids)
                entry["logprobs"] = {"tokens": tokens, "token_logprobs": list(c.logprobs)}
            out_choices.append(entry)
        return self._envelope("text_completion", rid, prompt_ids, choices, out_choices)

    def _token_logprobs(self, c: Choice) -> list[dict]:
        tok = self.renderer.tokenizer
        out = []
        for t, lp in zip(c.token_ids, c.logprobs, strict=True):
            text = tok.decode([t])
            out.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
        return out

    def _envelope(self, kind: str, rid: str, prompt_ids: list[int], choices: list[Choice], out: list[dict]) -> dict:
        completion_tokens = sum(len(c.token_ids) for c in choices)
        return {
            "id": rid,
            "object": kind,
            "created": int(time.time()),
            "model": self.backend.model_name,
            "choices": out,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                      "total_tokens": len(prompt_ids) + completion_tokens},
            # beyond OpenAI (vLLM's return_token_ids does the same): what the model saw and the
            # policy versions that sampled
            "prompt_token_ids": prompt_ids,
            "policy_versions": [[c.version_first, c.version_last] for c in choices],
        }
