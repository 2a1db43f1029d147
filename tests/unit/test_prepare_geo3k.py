"""configs/gpu/prepare_geo3k.py without the network: a hand-made Hub example becomes a row in verl's
geo3k layout, and the parquet files its --from-rows path writes are what the geo3k recipe reads."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
from PIL import Image

from async_rl.config import load_config
from async_rl.data import read_rows, row_to_prompt
from async_rl.images import decode, image_bytes

GPU = Path(__file__).resolve().parents[2] / "configs" / "gpu"
RECIPE = GPU / "1gpu_qwen2.5_vl_3b_geo3k.yaml"


def prepare():
    spec = importlib.util.spec_from_file_location("prepare_geo3k", GPU / "prepare_geo3k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def diagram(seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8))


def test_a_hub_example_becomes_a_verl_geo3k_row():
    prep = prepare()
    image = diagram()
    row = prep.to_row({"problem": "<image>Find x.", "answer": "2\\sqrt{221}", "images": [image]}, 7, "train")
    assert set(row) == {"data_source", "prompt", "images", "ability", "reward_model", "extra_info"}
    assert row["data_source"] == "hiyouga/geometry3k" and row["ability"] == "math"
    assert row["prompt"] == [{"role": "user", "content": f"<image>Find x. {prep.INSTRUCTION}"}]
    assert row["reward_model"] == {"style": "rule", "ground_truth": "2\\sqrt{221}"}
    assert row["extra_info"] == {"split": "train", "index": 7, "answer": "2\\sqrt{221}", "question": "<image>Find x."}
    (cell,) = row["images"]
    assert cell["path"] is None and cell["bytes"].startswith(b"\x89PNG")  # lossless: the pixels as given
    assert np.array_equal(np.asarray(decode(image_bytes(cell))), np.asarray(image))
    # a cell the datasets library left encoded keeps its bytes as published
    assert prep.image_cell({"bytes": b"JPEGDATA", "path": "x.jpg"}) == {"bytes": b"JPEGDATA", "path": None}


def test_from_rows_writes_what_the_geo3k_recipe_reads(tmp_path):
    prep = prepare()
    src = tmp_path / "hub"
    src.mkdir()
    for i in range(3):
        diagram(i).save(src / f"{i}.png")
    (src / "rows.jsonl").write_text("".join(
        json.dumps({"problem": f"<image>Find the area of shape {i}.", "answer": str(10 + i), "images": [f"{i}.png"]}) + "\n"
        for i in range(3)
    ))
    out = tmp_path / "geo3k"
    prep.main(["--from-rows", str(src / "rows.jsonl"), "--out", str(out), "--limit", "2"])
    files = f"[{out / 'train.parquet'}]"
    cfg = load_config(RECIPE, [f"data.train_files={files}", f"data.eval_files=[{out / 'test.parquet'}]"])
    rows = read_rows(out / "train.parquet")
    assert len(rows) == 2 and len(read_rows(out / "test.parquet")) == 2
    for i, row in enumerate(rows):
        prompt = row_to_prompt(row, i, "train", cfg.data, "train")
        assert prompt.answer == str(10 + i) and prompt.data_source == "hiyouga/geometry3k"
        assert prompt.messages[0].content.startswith(f"<image>Find the area of shape {i}.")
        (cell,) = row["images"]
        assert np.array_equal(np.asarray(decode(image_bytes(cell))), np.asarray(diagram(i)))


def test_the_recipe_renders_each_diagram_within_its_pixel_bounds(tmp_path):
    """Through a vision-language processor (the tiny Qwen2.5-VL preset's) at the recipe's vision.*:
    every prompt carries its diagram, scaled up to at least 256 image tokens (a 40x30 one: 14 x 19)."""
    from datasets import Dataset

    from async_rl.chat import PromptRenderer
    from async_rl.data import load_prompt_files
    from async_rl.models.tiny import resolve_model_path
    from async_rl.vision import image_token_id

    prep = prepare()
    rows = [prep.to_row({"problem": f"<image>Find y{i}.", "answer": str(i), "images": [diagram(i)]}, i, "test") for i in range(2)]
    Dataset.from_list(rows).to_parquet(tmp_path / "test.parquet")
    files = f"[{tmp_path / 'test.parquet'}]"
    cfg = load_config(RECIPE, [f"data.train_files={files}", f"data.eval_files={files}"])
    vl_dir = resolve_model_path("tiny-qwen2.5-vl", str(tmp_path / "models"))
    renderer = PromptRenderer(vl_dir, vision=cfg.vision)
    limit = cfg.generators.max_model_len - cfg.generators.max_tokens
    prompts = load_prompt_files([str(tmp_path / "test.parquet")], cfg.data, renderer, limit, "data.eval_files").prompts
    for i, p in enumerate(prompts):
        assert p.images == [row["bytes"] for row in rows[i]["images"]]
        assert p.token_ids.count(image_token_id(vl_dir)) == 14 * 19
