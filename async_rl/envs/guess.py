"""Guess-the-number: a game environment with feedback. The model guesses an integer in [low, high];
the environment answers 'higher', 'lower' or 'correct'. Reward 1 for a correct guess, less the more
turns it took (so the model learns to bisect), 0 if it never gets there."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

from async_rl.envs.base import Environment, EnvTurn, Episode
from async_rl.protocol import ChatMessage, Prompt, Sample
from async_rl.tasks.base import Task

_NUMBER = re.compile(r"-?\d+")


def game_prompt(prompt_id: int, low: int, high: int, seed: int) -> Prompt:
    secret = random.Random(seed * 1_000_003 + prompt_id).randint(low, high)
    question = (
        f"I am thinking of an integer between {low} and {high}. Guess it: answer with one number per turn. "
        "I will say 'higher', 'lower' or 'correct'."
    )
    return Prompt(
        prompt_id=prompt_id,
        messages=[ChatMessage("user", question)],
        answer=str(secret),
        data_source="guess_number",
        metadata={"low": low, "high": high},
    )


class GuessEpisode(Episode):
    def __init__(self, secret: int, turn_penalty: float) -> None:
        self.secret = secret
        self.turn_penalty = turn_penalty
        self.guesses = 0
        self.solved = False

    async def step(self, model_text: str, finished: bool) -> EnvTurn:
        numbers = _NUMBER.findall(model_text)
        if not numbers:
            return EnvTurn(messages=[ChatMessage("user", "Please answer with a number.")])
        self.guesses += 1
        guess = int(numbers[-1])
        if guess == self.secret:
            self.solved = True
            return EnvTurn(messages=[ChatMessage("user", "correct")], done=True)
        return EnvTurn(messages=[ChatMessage("user", "higher" if guess < self.secret else "lower")])

    async def final_reward(self, transcript: list[ChatMessage]) -> float:
        if not self.solved:
            return 0.0
        return max(0.0, 1.0 - self.turn_penalty * (self.guesses - 1))


class GuessNumberEnvironment(Environment):
    name = "guess_number"

    def __init__(self, turn_penalty: float = 0.1) -> None:
        self.turn_penalty = turn_penalty

    def start(self, prompt: Prompt) -> GuessEpisode:
        return GuessEpisode(int(prompt.answer), self.turn_penalty)


class GuessNumberTask(Task):
    """The game's prompts (task.name 'async_rl.envs.guess:GuessNumberTask' with env.name 'guess'): a
    secret in [1, 100] per prompt. Its `reward` scores a single answer (the environment scores episodes)."""

    name = "guess_number"

    def __init__(self, low: int = 1, high: int = 100) -> None:
        self.low = low
        self.high = high

    def prompts(self, seed: int) -> Iterator[Prompt]:
        prompt_id = 0
        while True:
            yield game_prompt(prompt_id, self.low, self.high, seed)
            prompt_id += 1

    def reward(self, sample: Sample) -> float:
        numbers = _NUMBER.findall(sample.completion)
        return float(bool(numbers) and numbers[-1] == sample.prompt.answer)
