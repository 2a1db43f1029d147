"""The calculator tool task as a user agent written against the `openai` SDK (function tools).

`env.name: agent:examples.calculator_agent:solve` (configs/smollm2_tools_agent.yaml). The engine
runs `solve` in its own process with a client pointed at the episode's route of the engine's
OpenAI-compatible endpoint; every call is recorded token in / token out and trained. The final
messages are returned, so the run's `task.reward` (math) scores the last answer.
"""

from __future__ import annotations

import json

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


def solve(client, prompt: list[dict], model: str, max_turns: int = 3) -> list[dict]:
    """Ask; run every calculator call the model makes and send the results back; stop at an answer."""
    messages = list(prompt)
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
