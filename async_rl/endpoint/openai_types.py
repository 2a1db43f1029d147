"""The subset of OpenAI's chat and completions request bodies the endpoint accepts, as typed structs.

Unknown fields are ignored (clients send `user`, `metadata`, ...); `stream` and other features we do not
serve are refused with a one-line error by the endpoint, not silently ignored."""

from __future__ import annotations

import msgspec

from async_rl.images import IMAGE_MARKER


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


class ImageUrl(msgspec.Struct, kw_only=True):
    url: str  # only data: URLs are served (endpoint/images.py): the endpoint fetches nothing
    detail: str = "auto"


class ContentPart(msgspec.Struct, kw_only=True):
    type: str  # 'text' | 'image_url' (a vision-language model's); other parts are ignored
    text: str = ""
    image_url: ImageUrl | None = None


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

    def marked_text(self) -> str:
        """The content with an `<image>` marker at each image part (how a vision-language model's
        renderer places them: `async_rl.vision.marked_parts`)."""
        if not isinstance(self.content, list):
            return self.text()
        return "".join(IMAGE_MARKER if p.type == "image_url" else p.text for p in self.content if p.type in ("text", "image_url"))


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
