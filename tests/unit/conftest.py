"""Unit tier fixtures shared by several modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from async_rl.models.tiny import resolve_model_path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The tiny-qwen2 preset's model folder, created offline once per session (tests only read it)."""
    return resolve_model_path("tiny-qwen2", str(tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="session")
def moe_model_dir(tmp_path_factory, model_dir) -> Path:
    """A tiny random Qwen3-MoE (2 layers, 8 experts, top-2) with the tiny preset's tokenizer."""
    from tests.unit._moe_fixtures import build_moe_dir

    return build_moe_dir("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"), model_dir)


@pytest.fixture(scope="session")
def qwen2_moe_dir(tmp_path_factory, model_dir) -> Path:
    """A tiny random Qwen2-MoE: routed experts beside a shared expert, no top-k renormalisation."""
    from tests.unit._moe_fixtures import build_moe_dir

    return build_moe_dir("qwen2_moe", tmp_path_factory.mktemp("qwen2_moe"), model_dir)


@pytest.fixture(scope="session")
def mixtral_moe_dir(tmp_path_factory, model_dir) -> Path:
    """A tiny random Mixtral (the upcycled smollm2-135m-moe preset's class): Llama attention, top-k renormalised."""
    from tests.unit._moe_fixtures import build_moe_dir

    return build_moe_dir("mixtral", tmp_path_factory.mktemp("mixtral_moe"), model_dir)
