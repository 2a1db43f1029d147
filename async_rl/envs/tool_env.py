"""A tool-use environment: the model may call tools (calculator, sandboxed Python) before it answers.

Each model turn is parsed for tool calls (`tool_calls.py`). Calls run off the event loop (the Python
tool in its own sandboxed process per call, `sandbox.py`); their results come back as `tool`
messages. A malformed call or an unknown tool gets an error message as its observation and is
counted. A turn without a call is the final answer, scored by the task's reward function.

`call_bonus` (default 0) optionally shapes the reward: the first model turn of an episode whose
tool calls all ran ok earns it once. A small model that never calls the tool gets no GRPO gradient
toward calling it; the bonus gives one, and being paid once per episode and well below the
answer's reward it cannot outweigh a correct answer (see benchmarks/results/tools_probe.md).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable

from async_rl.envs.base import Environment, EnvTurn, Episode
from async_rl.envs.tool_calls import ToolFormat, parse_turn
from async_rl.envs.tools import Tool
from async_rl.protocol import ChatMessage, Prompt, Sample

RewardFn = Callable[[Sample], float | Awaitable[float]]


def tool_instructions(tools: list[Tool], fmt: ToolFormat) -> str:
    """A system-prompt paragraph that tells the model which tools exist and how to call them."""
    lines = [f"- {t.name}: {t.description}" for t in tools]
    if fmt == "hermes":
        how = 'Call a tool with <tool_call>{"name": "NAME", "arguments": {"input": "..."}}</tool_call>.'
    else:
        how = 'Call a tool with <tool name="NAME">INPUT</tool>.'
    return "You can use these tools:\n" + "\n".join(lines) + f"\n{how} Answer without a tool call when you are done."


class ToolEpisode(Episode):
    def __init__(self, env: ToolEnvironment, prompt: Prompt) -> None:
        self.env = env
        self.prompt = prompt
        self.bonus_paid = False

    async def step(self, model_text: str, finished: bool) -> EnvTurn:
        parsed = parse_turn(model_text, self.env.fmt, self.env.tools.keys())
        if parsed.is_final:
            return EnvTurn(done=True)
        messages: list[ChatMessage] = []
        outcomes: list[str] = []
        for err in parsed.errors:
            messages.append(ChatMessage("tool", f"error: {err.message}"))
            outcomes.append(err.reason)
        failed = 0
        for call in parsed.calls:
            result = await asyncio.to_thread(self.env.tools[call.name].run, call.arguments)
            messages.append(ChatMessage("tool", f"{call.name}: {result.text}"))
            outcomes.append(result.outcome)
            failed += result.outcome != "ok"
        reward = None
        if self.env.call_bonus and not self.bonus_paid and parsed.calls and not parsed.errors and not failed:
            self.bonus_paid = True
            reward = self.env.call_bonus
        return EnvTurn(
            messages=messages,
            reward=reward,
            tool_calls=len(parsed.calls),
            tool_errors=len(parsed.errors) + failed,
            tool_outcomes=outcomes,
        )

    async def final_reward(self, transcript: list[ChatMessage]) -> float:
        answer = next((m.content for m in reversed(transcript) if m.role == "assistant"), "")
        value = self.env.reward(Sample(prompt=self.prompt, completion=answer))
        if inspect.isawaitable(value):
            value = await value
        return float(value)


class ToolEnvironment(Environment):
    name = "tools"

    def __init__(self, tools: list[Tool], reward: RewardFn, fmt: ToolFormat = "tag", call_bonus: float = 0.0) -> None:
        if len({t.name for t in tools}) != len(tools):
            raise ValueError("tool names must be unique")
        if call_bonus < 0:
            raise ValueError(f"call_bonus must be >= 0, got {call_bonus}")
        self.call_bonus = call_bonus  # paid once per episode for the first turn whose calls all ran ok
        self.tools = {t.name: t for t in tools}
        self.reward = reward
        self.fmt = fmt

    def system_prompt(self) -> str:
        return tool_instructions(list(self.tools.values()), self.fmt)

    def start(self, prompt: Prompt) -> ToolEpisode:
        return ToolEpisode(self, prompt)
