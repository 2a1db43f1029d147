"""A reward for the engine's tool-episode test: 1 for the answer 84, an exception for anything else
(the engine must keep that status for its own episode only)."""

from async_rl.protocol import Sample


def reward(sample: Sample) -> float:
    if sample.completion.strip() == "84":
        return 1.0
    raise ValueError(f"wrong answer {sample.completion!r}")
