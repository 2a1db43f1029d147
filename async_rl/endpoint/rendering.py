"""OpenAI chat messages <-> the model's tokens, and the model's text -> OpenAI `tool_calls`.

A full render goes through the model's chat template. Templates that know tools (Qwen2.5, Hermes:
the template mentions `tools`) get the request's tools and the assistant messages' `tool_calls`
natively; for templates that do not (SmolLM2), the tools are described in the system message in the
hermes format and an assistant's tool calls are written back as the `<tool_call>` text the model
produced. The model's output is parsed with our hermes parser (`envs/tool_calls.py`); vLLM's
Hermes2ProToolParser needs `<tool_call>` to be one token of the vocabulary, which SmolLM2's is not.

An episode's later calls are not re-rendered from their messages when they extend the previous call
(`EpisodeLog.splice`): their prompt is the previous prompt, the sampled tokens, then only the new
messages rendered by `ChatDelta` (what the built-in environments do). Re-rendering the assistant's
text would re-tokenize it, which is where multi-turn token drift comes from.

A vision-language model's renderer (`vision` set) renders through its processor: each `image_url` part
is an image content part whose placeholder is expanded to the image's tokens, as the prompt source and
the environments render images (`async_rl.vision`, `envs/vision_delta.py`).
"""

from __future__ import annotations

import json
from typing import Any

from async_rl.endpoint.openai_types import FunctionCall, Message, ToolCallOut, ToolSpec
from async_rl.envs.episode import ChatDelta, first_that_renders
from async_rl.envs.tool_calls import parse_turn, without_hermes_calls
from async_rl.protocol import ChatMessage
from async_rl.vision import VisionModel, marked_parts


def tools_paragraph(tools: list[ToolSpec]) -> str:
    """How a model without a tool format learns the request's tools (hermes format)."""
    specs = "\n".join(
        json.dumps({"name": t.function.name, "description": t.function.description, "parameters": t.function.parameters})
        for t in tools
    )
    return (
        "You can call these functions:\n" + specs + '\nCall one with <tool_call>{"name": "NAME", "arguments": '
        "{...}}</tool_call>. Answer without a tool call when you are done."
    )


def _arguments(text: str) -> dict | str:
    """A call's JSON arguments as an object (a malformed string stays the string the agent sent)."""
    try:
        return json.loads(text or "{}")
    except json.JSONDecodeError:
        return text


def tool_call_text(calls: list[ToolCallOut]) -> str:
    """An assistant's tool calls as the hermes text the model writes."""
    return "\n".join(
        "<tool_call>" + json.dumps({"name": c.function.name, "arguments": _arguments(c.function.arguments)}) + "</tool_call>"
        for c in calls
    )


class ParsedReply:
    """The model's text as an OpenAI assistant message: content without the calls, and the calls."""

    def __init__(self, content: str | None, tool_calls: list[ToolCallOut]) -> None:
        self.content = content
        self.tool_calls = tool_calls


def parse_reply(text: str, tools: list[ToolSpec] | None, call_id_prefix: str) -> ParsedReply:
    """Well-formed `<tool_call>` blocks naming a requested tool become `tool_calls`; the rest of the
    text (malformed calls included, so the agent sees them) is the content."""
    if not tools:
        return ParsedReply(text, [])
    parsed = parse_turn(text, "hermes", {t.function.name for t in tools})
    if not parsed.calls or parsed.errors:
        return ParsedReply(text, [])
    calls = [
        ToolCallOut(id=f"{call_id_prefix}-{k}", function=FunctionCall(name=c.name, arguments=json.dumps(c.arguments)))
        for k, c in enumerate(parsed.calls)
    ]
    rest = without_hermes_calls(text).strip()
    return ParsedReply(rest or None, calls)


class ChatRenderer:
    """Renders OpenAI messages with the model's tokenizer (one per engine); a vision-language model's
    (`vision`) with its processor, images included."""

    def __init__(self, tokenizer, end_of_turn_id: int, vision: VisionModel | None = None, max_image_pixels: int = 0) -> None:
        self.tokenizer = tokenizer
        self.vision = vision
        template = (getattr(vision.processor, "chat_template", None) if vision is not None else None) or getattr(
            tokenizer, "chat_template", None
        ) or ""
        if not template:
            raise ValueError("the model's tokenizer has no chat template: /v1/chat/completions cannot render messages")
        self.native_tools = "tools" in template
        if vision is not None:
            from async_rl.envs.vision_delta import VisionChatDelta

            self.delta: ChatDelta = VisionChatDelta(vision, end_of_turn_id, max_image_pixels)
        else:
            self.delta = ChatDelta(tokenizer, end_of_turn_id)
        self.end_of_turn_id = end_of_turn_id
        self.max_image_pixels = max_image_pixels

    @classmethod
    def for_model(
        cls, tokenizer, stop_ids: list[int], who: str, vision: VisionModel | None = None, max_image_pixels: int = 0
    ) -> ChatRenderer:
        """A renderer whose end-of-turn token is the first of the model's stop tokens that its chat
        template ends an assistant turn with (as the built-in environments pick it). `who` names the
        user in the error ('env=agent', 'the judge')."""
        return first_that_renders(lambda token: cls(tokenizer, token, vision, max_image_pixels), stop_ids, who)

    @property
    def image_token_id(self) -> int:
        """The image placeholder token (-1: a text-only model)."""
        return self.vision.image_token_id if self.vision is not None else -1

    def _content(self, m: Message) -> str:
        return m.marked_text() if self.vision is not None else m.text()

    def _as_template_messages(self, messages: list[Message], tools: list[ToolSpec] | None) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for m in messages:
            if self.native_tools:
                d: dict[str, Any] = {"role": m.role, "content": self._content(m)}
                if m.tool_calls:
                    d["tool_calls"] = [
                        {"type": "function", "id": c.id,
                         "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                        for c in m.tool_calls
                    ]
                if m.tool_call_id:
                    d["tool_call_id"] = m.tool_call_id
                out.append(d)
            else:
                text = self._content(m)
                if m.tool_calls:
                    text = "\n".join(p for p in (text, tool_call_text(m.tool_calls)) if p)
                out.append({"role": m.role, "content": text})
        if tools and not self.native_tools:
            paragraph = tools_paragraph(tools)
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + paragraph}
            else:
                out.insert(0, {"role": "system", "content": paragraph})
        if self.vision is not None:  # the processor's template takes content parts, images among them
            out = [{**d, "content": marked_parts(d["content"])} for d in out]
        return out

    def render(self, messages: list[Message], tools: list[ToolSpec] | None, images: list[bytes] | None = None) -> list[int]:
        """The whole conversation through the template, the assistant turn opened (`images`: those of
        the messages' image parts, in order, for a vision-language model)."""
        kwargs: dict[str, Any] = {"tools": [msg_tool(t) for t in tools]} if tools and self.native_tools else {}
        template_messages = self._as_template_messages(messages, tools)
        if self.vision is not None:
            return self.vision.tokens(template_messages, list(images or []), True, **kwargs)
        out = self.tokenizer.apply_chat_template(template_messages, add_generation_prompt=True, tokenize=True, **kwargs)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def render_after_reply(self, messages: list[Message], images: list[bytes] | None = None) -> list[int]:
        """Tokens after a finished assistant turn for `messages` (tool results, a user turn) plus the
        next assistant header; the template's own rendering of those roles (`images`: their images)."""
        return self.delta([ChatMessage(m.role, self._content(m)) for m in messages], list(images or []))


def msg_tool(t: ToolSpec) -> dict[str, Any]:
    return {"type": "function", "function": {"name": t.function.name, "description": t.function.description,
                                             "parameters": t.function.parameters}}
