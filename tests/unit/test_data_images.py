"""Dataset rows with images (verl's geo3k layout: an `images` column beside the chat prompt, whose text
holds `<image>` markers), from JSONL and parquet: paths relative to the data file, absolute paths,
bytes and datasets' image dicts read into `Prompt.images` and rendered with each image's placeholder
expanded; every bad image one line naming file and row, or skipped and counted by its reason."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from async_rl.chat import PromptRenderer
from async_rl.config import DataConfig, VisionConfig
from async_rl.data import load_prompt_files
from async_rl.errors import ConfigError
from async_rl.images import encode_png
from async_rl.models.tiny import resolve_model_path
from async_rl.protocol import Prompt
from async_rl.vision import image_token_id

# The tiny VL preset processes a 56x56 image into 4 placeholder tokens; 60x60 pixels is the most an
# image file may have here, so a 64x64 one is too large.
TOKENS_PER_IMAGE = 4
VISION = VisionConfig(max_images_per_prompt=2, max_image_pixels=60 * 60)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> Path:
    return resolve_model_path("tiny-qwen2.5-vl", str(tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="module")
def renderer(vl_dir) -> PromptRenderer:
    return PromptRenderer(vl_dir, vision=VISION)


def image(seed: int, size: int = 56) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return encode_png(Image.fromarray((rng.random((size, size, 3)) * 255).astype("uint8")))


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path: Path, rows: list[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def load(path: str, renderer: PromptRenderer, **data) -> list[Prompt]:
    return load_prompt_files([path], DataConfig(**data), renderer, 0, "data.train_files").prompts


def assert_rendered(p: Prompt, images: list[bytes], renderer: PromptRenderer, vl_dir: Path) -> None:
    """The row's images in order, rendered exactly as the prompt itself renders, each expanded."""
    assert p.images == images
    assert p.token_ids.count(image_token_id(vl_dir)) == TOKENS_PER_IMAGE * len(images)
    assert p.token_ids == renderer.render(Prompt(prompt_id=0, messages=p.messages, text=p.text, images=images))


# ---- rows with images -------------------------------------------------------------------------------


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet])
def test_geo3k_rows_with_image_paths_from_jsonl_and_parquet(tmp_path, renderer, vl_dir, writer):
    a, b, c = image(0), image(1), image(2)
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(a)
    (tmp_path / "img" / "b.png").write_bytes(b)
    (tmp_path / "c.png").write_bytes(c)
    rows = [
        # relative to the data file's folder, two images at their markers
        {"prompt": chat("<image>left, <image>right: which?"), "images": ["img/a.png", "img/b.png"], "answer": "a",
         "extra_info": {"split": "train"}},
        # an absolute path
        {"prompt": chat("<image>what?"), "images": [str(tmp_path / "c.png")], "answer": "c",
         "extra_info": {"split": "test"}},
        # no images: a text row beside them
        {"prompt": chat("no picture"), "images": [], "answer": "n", "extra_info": {"split": "train"}},
    ]
    name = "geo.jsonl" if writer is write_jsonl else "geo.parquet"
    p0, p1, p2 = load(writer(tmp_path / name, rows), renderer)
    assert_rendered(p0, [a, b], renderer, vl_dir)
    assert_rendered(p1, [c], renderer, vl_dir)
    assert p2.images == [] and image_token_id(vl_dir) not in p2.token_ids
    # the image column is consumed, not kept as metadata
    assert p0.metadata == {"extra_info.split": "train"} and p2.metadata == {"extra_info.split": "train"}


def test_parquet_image_bytes_and_datasets_image_dicts(tmp_path, renderer, vl_dir):
    a, b = image(0), image(1)
    (tmp_path / "b.png").write_bytes(b)
    raw = write_parquet(tmp_path / "raw.parquet", [{"prompt": "<image><image>:", "images": [a, b], "answer": "1"}])
    assert_rendered(load(raw, renderer)[0], [a, b], renderer, vl_dir)
    # the datasets library's Image feature: {bytes, path}, the bytes first, else the path (relative)
    dicts = [{"bytes": a, "path": "ignored.png"}, {"bytes": None, "path": "b.png"}]
    hf = write_parquet(tmp_path / "hf.parquet", [{"prompt": chat("<image>, <image>?"), "images": dicts, "answer": "1"}])
    (p,) = load(hf, renderer)
    assert_rendered(p, [a, b], renderer, vl_dir)
    assert p.metadata == {}


def test_one_image_as_the_cell_without_markers_and_a_missing_column(tmp_path, renderer, vl_dir):
    a = image(0)
    rows = [
        {"prompt": "what colour?", "picture": {"bytes": a, "path": None}, "answer": "1"},
        {"prompt": "no picture", "answer": "2"},  # the column missing from a row: no images
    ]
    p0, p1 = load(write_parquet(tmp_path / "d.parquet", rows), renderer, image_key="picture")
    assert_rendered(p0, [a], renderer, vl_dir)  # no marker: the image goes before the text
    assert p0.metadata == {}  # neither 'picture' nor its dict's 'picture.bytes'/'picture.path'
    assert p1.images == []


# ---- bad images -------------------------------------------------------------------------------------


def bad_rows(tmp_path: Path) -> list[tuple[dict, str, str]]:
    """(row, counter, words of its one-line error) for every way a row's images can be unusable."""
    (tmp_path / "ok.png").write_bytes(image(0))
    (tmp_path / "big.png").write_bytes(image(1, size=64))
    (tmp_path / "junk.png").write_bytes(b"not an image")
    return [
        ({"prompt": "<image>:", "images": ["gone.png"]}, "bad_image",
         f"column 'images' image 0: image file '{tmp_path / 'gone.png'}' does not exist"),
        ({"prompt": "<image><image>:", "images": ["ok.png", "junk.png"]}, "bad_image",
         "column 'images' image 1 ('junk.png'): not a readable image"),
        ({"prompt": "<image>:", "images": [7]}, "bad_image", "an image must be a path, bytes or"),
        ({"prompt": "<image>:", "images": ["big.png"]}, "image_too_large",
         "column 'images' image 0 ('big.png'): image of 64x64 = 4096 pixels is over vision.max_image_pixels=3600"),
        ({"prompt": "<image>" * 3, "images": ["ok.png"] * 3}, "too_many_images", "vision.max_images_per_prompt=2"),
        ({"prompt": "<image>:", "images": ["ok.png"] * 2}, "image_count", "2 image(s) for 1 '<image>' marker(s)"),
    ]


@pytest.mark.parametrize("case", range(6))
def test_a_bad_image_is_one_line_naming_file_and_row(tmp_path, renderer, case):
    bad, _, words = bad_rows(tmp_path)[case]
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "<image>:", "images": ["ok.png"]}, bad])
    with pytest.raises(ConfigError) as err:
        load(path, renderer, answer_key="")
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"data.train_files: '{path}' row 1: ") and words in text, text


def test_a_bad_image_in_bytes_is_named_by_its_place_in_the_column(tmp_path, renderer):
    path = write_parquet(tmp_path / "d.parquet", [{"prompt": "<image><image>:", "images": [image(0), b"junk"]}])
    with pytest.raises(ConfigError, match=r"d.parquet' row 0: column 'images' image 1: not a readable image \(4 bytes\)"):
        load(path, renderer, answer_key="")


def test_bad_images_are_skipped_and_counted_by_reason(tmp_path, renderer):
    rows = [{"prompt": "<image>:", "images": ["ok.png"]}] + [bad for bad, _, _ in bad_rows(tmp_path)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    loaded = load_prompt_files([path], DataConfig(answer_key="", skip_bad_rows=True), renderer, 0, "data.train_files")
    assert len(loaded.prompts) == 1 and loaded.prompts[0].images == [image(0)]
    assert dict(loaded.skipped) == {"bad_image": 3, "image_too_large": 1, "too_many_images": 1, "image_count": 1}


def test_images_for_a_text_only_model(tmp_path, model_dir):
    (tmp_path / "a.png").write_bytes(image(0))
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "<image>:", "images": ["a.png"], "answer": "1"}] * 2)
    text_only = PromptRenderer(model_dir)
    with pytest.raises(ConfigError) as err:
        load(path, text_only)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"data.train_files: '{path}' row 0: ")
    assert "has no vision tower" in text and "data.image_key=''" in text
    # skipping: every row is bad, which stays the one line for a file with no usable row
    with pytest.raises(ConfigError, match=r"no usable row .*'images_without_vision': 2"):
        load(path, text_only, skip_bad_rows=True)
    # data.image_key='': the files have no images, the column is only metadata
    p = load(path, text_only, image_key="")[0]
    assert p.images == [] and p.metadata == {"images": '["a.png"]'}
