"""A guess-the-number environment for the multi-turn integration test whose later prompts hold their
first environment turn until the test says the first weight sync happened (a marker file): their next
model turn then starts on the new weights, inside the same episode. Deterministic, no timing guess."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from async_rl.config import EnvConfig
from async_rl.envs.base import EnvTurn
from async_rl.envs.guess import GuessEpisode, GuessNumberEnvironment
from async_rl.protocol import Prompt

MARKER_ENV = "ASYNC_RL_TEST_SYNC_MARKER"  # the file the test writes after the first sync
GATED_FROM = 2  # prompt ids from here on (the second step's groups) wait for it
WAIT_S = 300.0  # a missing marker must not hang the run forever


class GatedEpisode(GuessEpisode):
    def __init__(self, secret: int, gated: bool) -> None:
        super().__init__(secret, turn_penalty=0.1)
        self.gated = gated

    async def step(self, model_text: str, finished: bool) -> EnvTurn:
        if self.gated:
            self.gated = False
            marker = Path(os.environ[MARKER_ENV])
            deadline = time.monotonic() + WAIT_S
            t0 = time.monotonic()
            while not marker.exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            with open(marker.parent / "gate.log", "a") as log:  # read by the test (-s) when it fails
                log.write(f"secret {self.secret}: held {time.monotonic() - t0:.1f}s, marker {marker.exists()}\n")
        return await super().step(model_text, finished)


class GatedGuess(GuessNumberEnvironment):
    def start(self, prompt: Prompt) -> GatedEpisode:
        return GatedEpisode(int(prompt.answer), gated=prompt.prompt_id >= GATED_FROM)


def make_env(cfg: EnvConfig, reward) -> GatedGuess:
    return GatedGuess()
