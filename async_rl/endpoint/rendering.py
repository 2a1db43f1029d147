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
"""

from __future__ import annotations

import json
from typing import Any

from async_rl.endpoint.openai_types import FunctionCall, Message, ToolCallOut, ToolSpec
from async_rl.envs.episode import ChatDelta, first_that_renders
from async_rl.envs.tool_calls import parse_turn, without_hermes_calls
from async_rl.protocol import ChatMessage


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
    """Renders OpenAI messages with the model's tokenizer (one per engine)."""

    def __init__(self, tokenizer, end_of_turn_id: int) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None) or ""
        if not template:
            raise ValueError("the model's tokenizer has no chat template: /v1/chat/completions cannot render messages")
        self.native_tools = "tools" in template
        self.delta = ChatDelta(tokenizer, end_of_turn_id)
        self.end_of_turn_id = end_of_turn_id

    @classmethod
    def for_model(cls, tokenizer, stop_ids: list[int], who: str) -> ChatRenderer:
        """A renderer whose end-of-turn token is the first of the model's stop tokens that its chat
        template ends an assistant turn with (as the built-in environments pick it). `who` names the
        user in the error ('env=agent', 'the judge')."""
        return first_that_renders(lambda token: cls(tokenizer, token), stop_ids, who)

    def _as_template_messages(self, messages: list[Message], tools: list[ToolSpec] | None) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for m in messages:
            if self.native_tools:
                d: dict[str, Any] = {"role": m.role, "content": m.text()}
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
                text = m.text()
                if m.tool_calls:
                    text = "\n".join(p for p in (text, tool_call_text(m.tool_calls)) if p)
                out.append({"role": m.role, "content": text})
        if tools and not self.native_tools:
            paragraph = tools_paragraph(tools)
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + paragraph}
            else:
                out.insert(0, {"role": "system", "content": paragraph})
        return out

    def render(self, messages: list[Message], tools: list[ToolSpec] | None) -> list[int]:
        """The whole conversation through the template, the assistant turn opened."""
        kwargs: dict[str, Any] = {"tools": [msg_tool(t) for t in tools]} if tools and self.native_tools else {}
        out = self.tokenizer.apply_chat_template(
            self._as_template_messages(messages, tools), add_generation_prompt=True, tokenize=True, **kwargs
        )
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def render_after_reply(self, messages: list[Message]) -> list[int]:
        """Tokens after a finished assistant turn for `messages` (tool results, a user turn) plus the
        next assistant header; the template's own rendering of those roles."""
        return self.delta([ChatMessage(m.role, m.text()) for m in messages])


def msg_tool(t: ToolSpec) -> dict[str, Any]:
    return {"type": "function", "function": {"name": t.function.name, "description": t.function.description,
                                             "parameters": t.function.parameters}}
