"""Fixtures and settings for every tier."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# A bare ray.init() joins the machine's running Ray cluster when there is one (a `ray start` head
# anywhere on the machine leaves its address in /tmp/ray/ray_current_cluster): the suite would then
# run on someone else's cluster and its resources. "local" always starts a fresh local Ray; a test that
# means a cluster passes its address explicitly. An address set by the caller is kept.
os.environ.setdefault("RAY_ADDRESS", "local")


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """The smollm2-135m preset's folder, fetched into the shared model cache if it is not there yet
    (as the integration tier does): tests that need its tokenizer or weights run on a fresh machine
    instead of skipping because nothing had fetched it before they were collected."""
    from tests._presets import smollm2_dir

    return smollm2_dir()
