"""The calculator tool task as a user agent written against the `openai` SDK (function tools).

`env.name: agent:examples.calculator_agent:solve` (configs/smollm2_tools_agent.yaml). The engine
runs `solve` in its own process with a client pointed at the episode's route of the engine's
OpenAI-compatible endpoint; every call is recorded token in / token out and trained. The final
messages are returned, so the run's `task.reward` (math) scores the last answer.
"""

from __future__ import annotations

import json
import re

from async_rl.envs.tool_env import tool_instructions
from async_rl.envs.tools import Calculator

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": Calculator.description,
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "an arithmetic expression"}},
            "required": ["expression"],
        },
    },
}


# The data's worked examples (configs/data/tools_*.jsonl) call the calculator in the built-in
# environment's tag format; a model shown those imitates them, and the endpoint (which tells it to use
# <tool_call> blocks) never sees a call: every episode ended in a tag-format "answer" scoring 0.
TAG_CALL = re.compile(r'<tool name="calculator">(.*?)</tool>', re.S)


def as_tool_calls(prompt: list[dict]) -> list[dict]:
    """The prompt with each worked example's tag-format call as an assistant `tool_calls` message and
    its result as the `tool` message answering that call: the endpoint renders both in the format the
    model is asked to use."""
    messages: list[dict] = []
    call_id = ""
    for m in prompt:
        call = TAG_CALL.fullmatch(m["content"].strip()) if m["role"] == "assistant" else None
        if call is not None:
            call_id = f"example_{len(messages)}"
            arguments = json.dumps({"expression": call.group(1).strip()})
            function = {"name": "calculator", "arguments": arguments}
            messages.append({"role": "assistant", "content": "",
                             "tool_calls": [{"id": call_id, "type": "function", "function": function}]})
        elif m["role"] == "tool" and call_id:
            messages.append({"role": "tool", "tool_call_id": call_id, "content": m["content"]})
            call_id = ""
        else:
            messages.append(dict(m))
    return messages


def solve(client, prompt: list[dict], model: str, max_turns: int = 3) -> list[dict]:
    """Ask; run every calculator call the model makes and send the results back; stop at an answer."""
    messages = as_tool_calls(prompt)
    tool = Calculator()
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR]).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                arguments = {}
            result = tool.run(arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"calculator: {result.text}"})
    return messages


def with_tag_instructions(prompt: list[dict]) -> list[dict]:
    """The prompt with the built-in tool environment's instructions for the tag format after the system
    prompt (a blank line between), as `env.name: tools` with `tool_format: tag` renders it."""
    paragraph = tool_instructions([Calculator()], "tag")
    messages = [dict(m) for m in prompt]
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = messages[0]["content"] + "\n\n" + paragraph
    else:
        messages.insert(0, {"role": "system", "content": paragraph})
    return messages


def solve_tagged(client, prompt: list[dict], model: str, max_turns: int = 3) -> list[dict]:
    """The same task as a homemade tool loop, without the tools API: the model writes its calls in the
    tag format its worked examples show (<tool name="calculator">EXPR</tool>), the agent finds them in
    the reply's text, runs them and sends each result back as a `tool` message. SmolLM2-135M writes
    much better expressions this way than in the tools API's JSON (see docs/agents.md)."""
    messages = with_tag_instructions(prompt)
    tool = Calculator()
    for _ in range(max_turns):
        text = client.chat.completions.create(model=model, messages=messages).choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        calls = TAG_CALL.findall(text)
        if not calls:
            break
        for expression in calls:
            messages.append({"role": "tool", "content": f"calculator: {tool.run({'expression': expression}).text}"})
    return messages
