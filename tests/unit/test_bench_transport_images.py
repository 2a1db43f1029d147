"""bench_transport.py --images: its arithmetic of Qwen2.5-VL's processed pixels against transformers'
own resize and image processor, and the frame it measures (the images' bytes in the header, once)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_transport as bt  # noqa: E402

from async_rl.protocol import decode_groups, encode_groups  # noqa: E402


def test_the_resize_is_transformers_smart_resize():
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    sides = (14, 30, 56, 223, 448, 1000, 1024, 3000)
    for (w, h), (lo, hi) in itertools.product(itertools.product(sides, sides), [(3136, 12845056), (200704, 1003520), (3136, 3136)]):
        if max(w, h) / min(w, h) > 200:  # refused by the processor
            continue
        want_h, want_w = smart_resize(h, w, 28, lo, hi)
        assert bt.qwen_vl_resized(w, h, lo, hi) == (want_w, want_h), (w, h, lo, hi)


@pytest.mark.parametrize(("size", "max_pixels"), [(56, 56 * 56), (100, 100 * 100), (448, 200704)])
def test_patches_times_4704_bytes_are_the_processors_pixel_values(size, max_pixels):
    patches = bt.qwen_vl_patches(size, size, bt.QWEN_MIN_PIXELS, max_pixels)
    got = bt.processor_patches(bt.natural_image(size, 0), bt.QWEN_MIN_PIXELS, max_pixels)
    assert got == (patches, patches * 4704)


def test_the_frame_carries_each_image_once_per_group():
    images = [bt.encode_image(bt.natural_image(56, seed), codec) for seed, codec in enumerate(bt.IMAGE_CODECS)]
    tokens = 2 * bt.qwen_vl_patches(56, 56, bt.QWEN_MIN_PIXELS, 56 * 56) // 4
    group = bt.image_group(images, tokens)
    _, (back,) = decode_groups(encode_groups(bt.RUN_ID, [group]), bt.RUN_ID)
    assert back.images == images and len(back.completions) == bt.IMAGE_GROUP
    extra = bt.frame_bytes(group) - bt.frame_bytes(bt.image_group([], 0))
    payload = sum(map(len, images)) + 4 * tokens  # the files, and the placeholders' int32 ids
    assert payload <= extra <= payload + 16  # msgpack's bin headers: a few bytes an image
