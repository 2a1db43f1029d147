"""Agents for tests/unit/test_agents.py (run by agent_main.py in their own processes)."""

from __future__ import annotations

import time


def _episode_index(client) -> int:
    """The sample index in the episode's route (.../episodes/<request>-s<i>/v1)."""
    return int(str(client.base_url).rstrip("/").split("/")[-2].rsplit("-s", 1)[1])


def two_calls(client, prompt, model):
    """Asks, then sends the reply back with a user follow-up (an append-only conversation)."""
    messages = list(prompt)
    reply = client.chat.completions.create(model=model, messages=messages).choices[0].message
    messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": "Are you sure?"}]
    client.chat.completions.create(model=model, messages=messages)
    return 1.0


def rewrites_history(client, prompt, model):
    """Second call drops the first reply and rewrites the question: a prefix break."""
    client.chat.completions.create(model=model, messages=list(prompt))
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say it again, shorter."}])
    return 0.5


def flaky(client, prompt, model):
    """Episode 0 hangs after one call, episode 1 raises after one call, the others finish."""
    client.chat.completions.create(model=model, messages=list(prompt))
    i = _episode_index(client)
    if i == 0:
        time.sleep(600)
    if i == 1:
        raise RuntimeError("the agent broke")
    return 1.0


def final_messages(client, prompt, model):
    reply = client.chat.completions.create(model=model, messages=list(prompt)).choices[0].message
    return list(prompt) + [{"role": "assistant", "content": reply.content}]


async def async_agent(client, prompt, model):
    reply = await client.chat.completions.create(model=model, messages=list(prompt))
    return float(len(reply.choices))


def rewrites_per_episode(client, prompt, model):
    """Episode i makes i + 1 calls, each rewriting the conversation (i prefix breaks); reward i / 2."""
    i = _episode_index(client)
    client.chat.completions.create(model=model, messages=list(prompt))
    for k in range(i):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Again, take {k}."}])
    return i / 2


def records_its_window(client, prompt, model):
    """One call, then holds its process for 3 s; writes when it ran to $ASYNC_RL_TEST_WINDOWS/<episode>."""
    import os
    from pathlib import Path

    start = time.time()
    client.chat.completions.create(model=model, messages=list(prompt))
    time.sleep(3.0)
    Path(os.environ["ASYNC_RL_TEST_WINDOWS"], str(_episode_index(client))).write_text(f"{start} {time.time()}")
    return 1.0
