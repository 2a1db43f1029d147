"""Unit tier fixtures shared by several modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from async_rl.models.tiny import resolve_model_path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The tiny-qwen2 preset's model folder, created offline once per session (tests only read it)."""
    return resolve_model_path("tiny-qwen2", str(tmp_path_factory.mktemp("models")))
