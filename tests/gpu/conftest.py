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


# A test that hangs (seen on an H200, 2026-11-26: part A stopped twice at the same test until the
# check's timeout killed it, with no junit and no stack) fails alone after this long where
# pytest-timeout is installed (the device image has it), with the hung thread's stack in the report.
GPU_TEST_TIMEOUT_S = 90


def pytest_collection_modifyitems(config, items):
    missing = cuda_missing()
    bounded = config.pluginmanager.hasplugin("timeout")
    for item in items:
        path = str(item.fspath)
        if "tests/gpu/" not in path:
            continue
        item.add_marker(pytest.mark.gpu)
        if bounded and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(GPU_TEST_TIMEOUT_S))
        if "tests/gpu/e2e/" in path:
            item.add_marker(pytest.mark.gpu_e2e)
        if missing:
            item.add_marker(pytest.mark.skip(reason=missing))


# `make gpu-check` runs part A with --exit-3-without-cuda: where CUDA is missing the run ends with one
# line `SKIP: <reason>` and exit status 3 (skipped, with its reason), the convention of every part
# of the check, instead of a green run in which every test was skipped.
EXIT_SKIPPED = 3


def pytest_addoption(parser):
    parser.addoption(
        "--exit-3-without-cuda",
        action="store_true",
        default=False,
        help="without CUDA: print 'SKIP: <reason>' last and exit 3 (scripts/gpu_check.py)",
    )


def pytest_sessionfinish(session, exitstatus):
    if session.config.getoption("--exit-3-without-cuda", default=False) and cuda_missing():
        if exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = EXIT_SKIPPED


def pytest_unconfigure(config):
    if config.getoption("--exit-3-without-cuda", default=False) and (missing := cuda_missing()):
        print(f"SKIP: {missing}", flush=True)
