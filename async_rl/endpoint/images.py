"""Images in OpenAI chat requests: `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`.

Only data URLs are served. The engine's node may not reach the network (and the run must not depend on
what a URL serves when the sample is trained), so an http(s) or any other URL is refused, as is a data
URL that is not base64 or whose bytes are no image, each with one line naming the message and the part.
The decoded files go to the engine and into the trained episode as they are (`async_rl.images`).
"""

from __future__ import annotations

import base64
import binascii

from async_rl.endpoint.openai_types import Message
from async_rl.images import ImageError, check


class ImagePartError(ValueError):
    """A request's image part that cannot be served (the endpoint answers 400 with this line)."""


def part_image(url: str, where: str, max_pixels: int) -> bytes:
    """The encoded image of one image_url part (`where`: 'messages[1].content[0]')."""
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else "a relative"
        raise ImagePartError(
            f"{where}: image_url must be a data URL (data:image/png;base64,...), not {scheme!r}: the endpoint fetches nothing"
        )
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ImagePartError(f"{where}: a data URL needs ';base64,' before its bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImagePartError(f"{where}: the data URL's payload is not base64") from None
    try:
        check(data, max_pixels)
    except ImageError as exc:
        raise ImagePartError(f"{where}: {exc}") from None
    return data


def request_images(messages: list[Message], max_pixels: int) -> list[bytes]:
    """Every image of `messages`, in order (messages, then parts). ImagePartError: the first bad part."""
    images = []
    for i, m in enumerate(messages):
        if not isinstance(m.content, list):
            continue
        for j, part in enumerate(m.content):
            if part.type != "image_url":
                continue
            where = f"messages[{i}].content[{j}]"
            if part.image_url is None or not part.image_url.url:
                raise ImagePartError(f"{where}: an image_url part without image_url.url")
            images.append(part_image(part.image_url.url, where, max_pixels))
    return images
