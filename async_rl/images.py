"""Images of vision-language prompts: read, checked, decoded. One place for what an image may be.

A prompt's image is an encoded file (PNG, JPEG, WebP, ...) kept as its bytes from the moment it is read
(`Prompt.images`) to the learner (`GroupMeta.images`): the engine and the learner decode the same bytes
and run the same processor settings over them, so the learner trains on the pixels the engine saw.
A dataset cell may be a path (relative to the data file), raw bytes, or Hugging Face datasets' image
dict {"bytes": ..., "path": ...}. A bad image is an `ImageError` whose reason is a counter name and
whose message is one line.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL import Image

# The marker a prompt's text uses for each of its images (verl's geo3k layout); a prompt without
# markers has its images before its text.
IMAGE_MARKER = "<image>"


class ImageError(ValueError):
    """An image that cannot be used: `reason` is the counter it lands in, the message one line."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def image_bytes(cell: Any, base_dir: Path | None = None) -> bytes:
    """The encoded image a dataset cell names: bytes as they are, a path (relative to `base_dir`) read,
    or the datasets library's {"bytes", "path"} dict. ImageError (`bad_image`) otherwise."""
    if isinstance(cell, dict):
        data, path = cell.get("bytes"), cell.get("path")
        if data:
            return image_bytes(data)
        if path:
            return image_bytes(path, base_dir)
        raise ImageError("bad_image", "an image dict without 'bytes' or 'path'")
    if isinstance(cell, bytes | bytearray | memoryview):
        if not cell:
            raise ImageError("bad_image", "an empty image (0 bytes)")
        return bytes(cell)
    if isinstance(cell, str) and cell:
        p = Path(cell).expanduser()
        if not p.is_absolute() and base_dir is not None:
            p = base_dir / p
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            raise ImageError("bad_image", f"image file '{p}' does not exist") from None
        except OSError as exc:
            raise ImageError("bad_image", f"image file '{p}' cannot be read: {exc.strerror or exc}") from None
        if not data:
            raise ImageError("bad_image", f"image file '{p}' is empty")
        return data
    raise ImageError("bad_image", f"an image must be a path, bytes or {{'bytes', 'path'}}, not {type(cell).__name__}")


def decode(data: bytes) -> Image.Image:
    """The image as RGB pixels. ImageError (`bad_image`) when the bytes are no image PIL can read."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError("bad_image", f"not a readable image ({len(data)} bytes): {_why(exc)}") from None


def _why(exc: Exception) -> str:
    """PIL's reason in one short line (its 'cannot identify' message names a memory address: not kept)."""
    from PIL import UnidentifiedImageError

    if isinstance(exc, UnidentifiedImageError):
        return "no image format PIL knows"
    return (str(exc).splitlines() or [type(exc).__name__])[0][:120]


def check(data: bytes, max_pixels: int) -> tuple[int, int]:
    """(width, height) of an encoded image after checking it decodes and has at most `max_pixels`
    pixels (0: no limit). Only the header is read for the size; the whole image is decoded once."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            width, height = im.size
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError("bad_image", f"not a readable image ({len(data)} bytes): {_why(exc)}") from None
    if max_pixels and width * height > max_pixels:
        raise ImageError(
            "image_too_large", f"image of {width}x{height} = {width * height} pixels is over vision.max_image_pixels={max_pixels}"
        )
    decode(data)  # truncated files open but fail to load
    return width, height


def encode_png(image: Image.Image) -> bytes:
    """An image as PNG bytes (lossless: what the engine decodes is what was drawn)."""
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
