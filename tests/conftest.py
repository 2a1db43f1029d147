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
# Ray starts idle workers for the first driver by default; every actor of a run asks for its own
# resources and runtime environment and starts a worker of its own anyway. Off: ~1.5 s less CPU per
# ray.init and shutdown (6.3 and 5.2 s against 7.4 and 7.3 s, measured on the 2-core machine), and the
# suite starts about forty Ray clusters (one per module, and the runs it launches as a user does).
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")


def _rotated_cores(worker: str) -> str:
    """Worker gwK's core order: this machine's cores rotated by K (gw0 '0,1', gw1 '1,0')."""
    cores = sorted(os.sched_getaffinity(0))
    k = int(worker.removeprefix("gw")) % len(cores)
    return ",".join(map(str, cores[k:] + cores[:k]))


# `make test` runs the suite in parallel workers (pytest-xdist), each a separate run on the same cores.
# A run pins its first engine to the first core of its order (placement.available_cores): without a
# worker's own order every worker's engine would share core 0 while the learners share core 1.
if "PYTEST_XDIST_WORKER" in os.environ and hasattr(os, "sched_getaffinity"):
    os.environ.setdefault("ASYNC_RL_CORES", _rotated_cores(os.environ["PYTEST_XDIST_WORKER"]))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The integration tier first: `make test` hands whole files to its workers in collection order
    (--dist loadfile --no-loadscope-reorder), so the long files start first and the short unit files
    fill in at the end, instead of one worker finishing a long file alone."""
    items.sort(key=lambda item: "integration" not in item.path.parts)  # stable: files keep their order


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """The smollm2-135m preset's folder, fetched into the shared model cache if it is not there yet
    (as the integration tier does): tests that need its tokenizer or weights run on a fresh machine
    instead of skipping because nothing had fetched it before they were collected."""
    from tests._presets import smollm2_dir

    return smollm2_dir()
