"""The subset of OpenAI's chat and completions request bodies the endpoint accepts, as typed structs.

Unknown fields are ignored (clients send `user`, `metadata`, ...); `stream` and other features we do not
serve are refused with a one-line error by the endpoint, not silently ignored."""

from __future__ import annotations

import msgspec


class FunctionSpec(msgspec.Struct, kw_only=True):
    name: str
    description: str = ""
    parameters: dict = {}


class ToolSpec(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: FunctionSpec


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallOut(msgspec.Struct, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCall


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str = ""


class Message(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallOut] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined; None is '')."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if p.type == "text")


class ChatRequest(msgspec.Struct, kw_only=True):
    model: str = ""
    messages: list[Message]
    tools: list[ToolSpec] | None = None
    tool_choice: str | dict | None = None
    n: int = 1
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    stream: bool = False


class CompletionRequest(msgspec.Struct, kw_only=True):
    model: str = ""
    prompt: str | list[int]
    n: int = 1
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    logprobs: int | None = None
    stream: bool = False
