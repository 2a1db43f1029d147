"""The agent of tests/integration/test_agents_real.py: three chat calls through the openai SDK, each
sending the conversation back with a user follow-up (an append-only episode). Episodes of prompts from
GATED_FROM on hold after their first call until the test writes the marker (after the first weight
sync), so their later calls run on newer weights than their first: a weight update inside an episode.
Each group's second episode (sample index 1) rewrites history for its third call (the first exchange
dropped): a prefix break, so that episode trains as two segments."""

from __future__ import annotations

import os
import time
from pathlib import Path

MARKER_ENV = "ASYNC_RL_TEST_AGENT_MARKER"
GATED_FROM = 2
WAIT_S = 300.0
FOLLOW_UP = "Say that again in fewer words."


def _prompt_id(client) -> int:
    """From the episode's route: .../episodes/e{engine}-r{n}-p{prompt}-s{i}/v1."""
    episode = str(client.base_url).rstrip("/").split("/")[-2]
    return int(episode.rsplit("-p", 1)[1].split("-s", 1)[0])


def three_calls(client, prompt, model) -> float:
    messages = list(prompt)
    lengths = []
    rewrites = str(client.base_url).rstrip("/").split("/")[-2].endswith("-s1")
    for k in range(3):
        if k == 2 and rewrites:  # the first exchange dropped: the prompt does not extend the episode
            messages = list(prompt) + [{"role": "user", "content": FOLLOW_UP}]
        elif k:
            messages.append({"role": "user", "content": FOLLOW_UP})
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=24).choices[0].message
        messages.append({"role": "assistant", "content": reply.content or ""})
        lengths.append(len(reply.content or ""))
        if k == 0 and _prompt_id(client) >= GATED_FROM:
            marker = Path(os.environ[MARKER_ENV])
            deadline = time.monotonic() + WAIT_S
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
    return -lengths[-1] / 100.0  # shorter last answers score higher: some signal for GRPO
