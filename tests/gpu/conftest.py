"""GPU tier: every test here is marked `gpu` and skipped where CUDA is not available."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)
            if not has_cuda:
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))
