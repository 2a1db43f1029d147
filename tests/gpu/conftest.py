"""GPU tier (`make test-gpu`): every test here is marked `gpu` and skipped, with the reason, where
CUDA is not available. Part A (this folder) needs torch, CuPy, megatron-core and transformers; part B
(e2e/, also marked `gpu_e2e`) needs vLLM and Ray too. Each module skips naming the package it lacks."""

from __future__ import annotations

import pytest


def cuda_missing() -> str:
    """'' when CUDA is usable; otherwise exactly what is missing."""
    try:
        import torch
    except ImportError:
        return "needs CUDA: torch is not installed"
    if torch.version.cuda is None:
        return f"needs CUDA: torch {torch.__version__} is a CPU build (install the CUDA wheel)"
    if not torch.cuda.is_available():
        visible = __import__("os").environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return f"needs CUDA: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU{where}"
    return ""


def pytest_collection_modifyitems(config, items):
    missing = cuda_missing()
    for item in items:
        path = str(item.fspath)
        if "tests/gpu/" not in path:
            continue
        item.add_marker(pytest.mark.gpu)
        if "tests/gpu/e2e/" in path:
            item.add_marker(pytest.mark.gpu_e2e)
        if missing:
            item.add_marker(pytest.mark.skip(reason=missing))
