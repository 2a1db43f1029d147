"""`stream: true` for chat completions: the whole completion, once generated, as OpenAI's server-sent
events (`chat.completion.chunk`s, then `data: [DONE]`).

Nothing is streamed token by token: a call is recorded whole (token in / token out) and its tool calls
are parsed from the finished text, so the stream carries per choice one chunk with the role, the
content and the tool calls, then one with the finish reason, then (with `stream_options.
include_usage`) one with the usage. Clients that always stream (verifiers' harness programs, agent
SDKs) read the same reply as a non-streamed call."""

from __future__ import annotations

import msgspec


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class StreamFlags(msgspec.Struct, kw_only=True):
    """The streaming fields of a request body (the rest is ignored here)."""

    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def chat_completion_chunks(completion: dict, include_usage: bool) -> list[dict]:
    """The `chat.completion.chunk` events that deliver `completion` (a `chat.completion` body)."""
    head = {"id": completion["id"], "object": "chat.completion.chunk", "created": completion["created"],
            "model": completion["model"]}
    chunks = []
    for choice in completion["choices"]:
        message = choice["message"]
        delta: dict = {"role": "assistant", "content": message["content"]}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        first = {"index": choice["index"], "delta": delta, "finish_reason": None, "token_ids": choice["token_ids"]}
        if "logprobs" in choice:
            first["logprobs"] = choice["logprobs"]
        chunks.append({**head, "choices": [first], "prompt_token_ids": completion["prompt_token_ids"]})
        chunks.append({**head, "choices": [{"index": choice["index"], "delta": {}, "finish_reason": choice["finish_reason"]}]})
    if include_usage:
        chunks.append({**head, "choices": [], "usage": completion["usage"],
                       "policy_versions": completion["policy_versions"]})
    return chunks


def sse_body(chunks: list[dict]) -> bytes:
    """Server-sent events: one `data:` line per chunk, then `data: [DONE]`."""
    return b"".join(b"data: " + msgspec.json.encode(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
