"""'colour': a visual task whose images are drawn by code. The image shows one filled square on a
black background; the completion should repeat the letter of its colour (r, g, b or y).

Prompt: one 56x56 PNG (the square's size, place and exact shade drawn at random) and the text
'<image>colour:', the same for every prompt, so only the pixels tell the answer: a model that ignores
them scores at most 1/4 per character (chance), a model that sees them scores up to 1. Reward as in
'repeat': the fraction of the completion's first `length` characters that are the colour's letter.
`blank=True` (task 'colour_blank') draws every image black: the control run that must stay at chance.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from async_rl.protocol import Prompt, Sample
from async_rl.tasks.base import Task

SIZE = 56
COLOURS = {"r": (220, 30, 30), "g": (30, 200, 40), "b": (40, 60, 230), "y": (230, 220, 30)}
TEXT = "<image>colour:"


def draw(letter: str, rng: random.Random, blank: bool = False) -> bytes:
    """One prompt's image: a square of `letter`'s colour (shade jittered), as PNG bytes."""
    from PIL import Image, ImageDraw

    from async_rl.images import encode_png

    image = Image.new("RGB", (SIZE, SIZE), (0, 0, 0))
    if not blank:
        side = rng.randint(14, 40)
        x, y = rng.randint(0, SIZE - side), rng.randint(0, SIZE - side)
        shade = tuple(max(0, min(255, c + rng.randint(-20, 20))) for c in COLOURS[letter])
        ImageDraw.Draw(image).rectangle([x, y, x + side - 1, y + side - 1], fill=shade)
    return encode_png(image)


class ColourTask(Task):
    name = "colour"

    def __init__(self, length: int = 8, blank: bool = False) -> None:
        self.length = length
        self.blank = blank

    def prompts(self, seed: int) -> Iterator[Prompt]:
        rng = random.Random(seed)
        letters = sorted(COLOURS)
        i = 0
        while True:
            letter = rng.choice(letters)
            yield Prompt(prompt_id=i, text=TEXT, answer=letter, images=[draw(letter, rng, self.blank)])
            i += 1

    def reward(self, sample: Sample) -> float:
        head = sample.completion[: self.length]
        return sum(1 for ch in head if ch == sample.prompt.answer) / self.length


def blank_colour() -> ColourTask:
    """'colour_blank': the same prompts with every image black (the control)."""
    task = ColourTask(blank=True)
    task.name = "colour_blank"
    return task
