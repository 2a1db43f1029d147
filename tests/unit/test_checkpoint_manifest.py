"""A checkpoint carries a manifest; a damaged one is named, set aside and passed over for the one
before it (async_rl/control/checkpoint.py, async_rl/control/checkpoint_manifest.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from async_rl.control import checkpoint, checkpoint_manifest
from async_rl.control.supervisor import latest_checkpoint
from async_rl.errors import ConfigError
from tests.unit.test_checkpoint_partial import write

WEIGHTS = "model/model.safetensors"


def truncate(ckpt: Path, rel: str = WEIGHTS) -> None:
    f = ckpt / rel
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def test_the_manifest_lists_every_file_with_its_size_and_checksum(tmp_path):
    ckpt = write(tmp_path, 4, weights=b"w" * 1000)
    listed = {e["path"]: e for e in json.loads((ckpt / checkpoint_manifest.MANIFEST).read_text())["files"]}
    on_disk = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()} - {checkpoint_manifest.MANIFEST}
    assert set(listed) == on_disk and {WEIGHTS, checkpoint.RUN_STATE, checkpoint.GROUPS_FILE} <= on_disk
    assert listed[WEIGHTS]["size"] == 1000
    assert checkpoint_manifest.verify(ckpt) == checkpoint_manifest.Verdict(str(ckpt), verified=True)


@pytest.mark.parametrize("damage", ["truncated", "flipped", "missing"])
def test_each_kind_of_damage_is_named_with_its_file(tmp_path, damage):
    ckpt = write(tmp_path, 4, weights=b"w" * 1000)
    f = ckpt / WEIGHTS
    if damage == "truncated":
        truncate(ckpt)
    elif damage == "flipped":  # same size, other bytes: only the checksum sees it
        f.write_bytes(b"x" + f.read_bytes()[1:])
    else:
        f.unlink()
    verdict = checkpoint_manifest.verify(ckpt)
    assert not verdict.intact and verdict.damaged.startswith(WEIGHTS)
    assert {"truncated": "500 bytes", "flipped": "checksum", "missing": "missing"}[damage] in verdict.damaged


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_one_before_is_resumed(tmp_path):
    write(tmp_path, 10)
    newest = write(tmp_path, 12, weights=b"w" * 100)
    truncate(newest)
    out = io.StringIO()
    assert checkpoint.choose(tmp_path, out) == tmp_path / "checkpoints" / "step_10"
    line = out.getvalue().strip()
    assert len(line.splitlines()) == 1 and "step_12" in line and WEIGHTS in line and "set aside" in line
    aside = [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("damaged-step_12-")]
    assert len(aside) == 1 and (aside[0] / WEIGHTS).is_file()  # kept, not deleted
    assert [p.name for p in checkpoint.completed(tmp_path)] == ["step_10"]
    # named explicitly, the damaged folder is still the user's to resume from, with a warning
    warned = io.StringIO()
    assert checkpoint.choose(aside[0], warned) == aside[0]
    assert "damaged" in warned.getvalue() and checkpoint.resume_run_dir(aside[0]) == tmp_path
    # a later commit's retention never removes it
    write(tmp_path, 14), write(tmp_path, 16), write(tmp_path, 18)
    assert aside[0].is_dir()


def test_a_learner_recovery_passes_over_a_damaged_checkpoint_too(tmp_path):
    write(tmp_path, 5)
    truncate(write(tmp_path, 8, weights=b"w" * 64))
    out = io.StringIO()
    assert latest_checkpoint(tmp_path, out).endswith("step_5")
    assert out.getvalue().startswith("[recovery]") and "step_8" in out.getvalue()


def test_every_checkpoint_damaged_is_one_line_error(tmp_path):
    truncate(write(tmp_path, 3, weights=b"w" * 64))
    with pytest.raises(ConfigError, match="every checkpoint .* is damaged"):
        checkpoint.choose(tmp_path, io.StringIO())


def test_a_checkpoint_without_a_manifest_loads_with_a_note(tmp_path):
    ckpt = write(tmp_path, 6)
    (ckpt / checkpoint_manifest.MANIFEST).unlink()  # as written before manifests existed
    out = io.StringIO()
    assert checkpoint.choose(tmp_path, out) == ckpt
    assert "no manifest" in out.getvalue() and "unverified" in out.getvalue()


def test_verify_command_reports_every_checkpoint_and_fails_on_damage(tmp_path, capsys):
    write(tmp_path, 1)
    assert checkpoint.main(["verify", str(tmp_path)]) == 0
    truncate(write(tmp_path, 2, weights=b"w" * 64))
    assert checkpoint.main(["verify", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2:] == ["step_1: intact", f"step_2: damaged: {WEIGHTS} has 32 bytes, the manifest 64"]
    assert checkpoint.main(["verify", str(tmp_path / "nowhere")]) == 2
