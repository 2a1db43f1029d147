"""Tool calls in a model turn: parsed into typed calls, or a typed error the model sees as its observation.

Two formats:
- `hermes`: the JSON-in-tags format that Qwen2.5, Hermes and many chat templates use for tools,
  `<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>`;
- `tag`: a plain format for models whose chat template has no tool format (SmolLM2),
  `<tool name="calculator">2+3</tool>`: the body is the tool's single `input` argument.

A turn with no call is a final answer. A malformed call or an unknown tool is not an exception: it
becomes a `ToolCallError` that the environment answers with an error message and counts.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import msgspec

ToolFormat = Literal["hermes", "tag"]
ArgValue = str | int | float | bool | None


class ToolCall(msgspec.Struct, frozen=True):
    name: str
    arguments: dict[str, ArgValue]


class ToolCallError(msgspec.Struct, frozen=True):
    """A call the parser could not turn into a ToolCall; `message` is shown to the model."""

    reason: Literal["malformed", "unknown_tool"]
    message: str


class ParsedTurn(msgspec.Struct, frozen=True):
    calls: list[ToolCall]
    errors: list[ToolCallError]

    @property
    def is_final(self) -> bool:
        """No call and no attempt at one: the model answered."""
        return not self.calls and not self.errors


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_HERMES_OPEN = re.compile(r"<tool_call>(?!.*</tool_call>)", re.S)
_TAG = re.compile(r'<tool\s+name\s*=\s*"([^"]*)"\s*>(.*?)</tool>', re.S)
_TAG_OPEN = re.compile(r"<tool[\s>]")


def _hermes_call(body: str) -> ToolCall | ToolCallError:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCallError("malformed", f"tool call is not valid JSON: {exc.msg} at column {exc.colno}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCallError("malformed", 'tool call must be a JSON object with a string "name"')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models send the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCallError("malformed", '"arguments" is a string that is not JSON')
    if not isinstance(args, dict) or not all(
        isinstance(v, (str, int, float, bool)) or v is None for v in args.values()
    ):
        return ToolCallError("malformed", '"arguments" must be an object of plain values')
    return ToolCall(obj["name"], dict(args))


def without_hermes_calls(text: str) -> str:
    """`text` with its well-formed hermes `<tool_call>` blocks removed (the prose around them)."""
    return _HERMES.sub("", text)


def parse_turn(text: str, fmt: ToolFormat, known_tools: frozenset[str] | set[str]) -> ParsedTurn:
    """Every tool call in `text`, in order; unknown tool names and malformed calls become errors."""
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
    if fmt == "hermes":
        found = [_hermes_call(m.group(1).strip()) for m in _HERMES.finditer(text)]
        if _HERMES_OPEN.search(_HERMES.sub("", text)):
            found.append(ToolCallError("malformed", "<tool_call> is not closed by </tool_call>"))
    else:
        found = [ToolCall(m.group(1).strip(), {"input": m.group(2).strip()}) for m in _TAG.finditer(text)]
        if _TAG_OPEN.search(_TAG.sub("", text)):
            found.append(ToolCallError("malformed", 'write a tool call as <tool name="NAME">INPUT</tool>'))
    for item in found:
        if isinstance(item, ToolCallError):
            errors.append(item)
        elif item.name not in known_tools:
            names = ", ".join(sorted(known_tools)) or "none"
            errors.append(ToolCallError("unknown_tool", f"unknown tool '{item.name}' (tools: {names})"))
        else:
            calls.append(item)
    return ParsedTurn(calls, errors)
