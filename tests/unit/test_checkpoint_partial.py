"""A checkpoint cut short (its writer killed) is never what a resume or a recovery restores, and its
`.tmp-` folder is removed (async_rl/control/checkpoint.py)."""

from __future__ import annotations

import io
import shutil
import time
from pathlib import Path

import pytest

from async_rl.buffer.actor import BufferState
from async_rl.buffer.ledger import Accounts
from async_rl.control import checkpoint
from async_rl.errors import ConfigError


def state(step: int) -> checkpoint.RunCheckpoint:
    buffer = BufferState(
        accounts=Accounts(), generator_version=step, prompts_drawn=0, rejected_frames={}, reward_errors=0,
        reward_timeouts=0,
    )
    return checkpoint.RunCheckpoint(step=step, version=step, buffer=buffer, saved_at=time.time())


def write(run_dir: Path, step: int, weights: bytes = b"w") -> Path:
    """A checkpoint as the controller writes one: the ranks' files into `begin`'s folder, then commit."""
    tmp = checkpoint.begin(run_dir)
    (tmp / "model").mkdir()
    (tmp / "model" / "model.safetensors").write_bytes(weights)
    return checkpoint.commit(tmp, state(step), keep=3)


def test_a_checkpoint_cut_short_is_never_picked_and_is_removed(tmp_path):
    write(tmp_path, 2)
    # killed before its rename: everything written, run state included, but still a .tmp- folder
    cut = checkpoint.begin(tmp_path)
    (cut / "model").mkdir()
    (cut / checkpoint.RUN_STATE).write_bytes(b'{"step": 4')  # torn, and newer than step_2
    # killed after the ranks' first files, before the run state
    early = checkpoint.begin(tmp_path)
    (early / "trainer_state.pt").write_bytes(b"")
    assert checkpoint.latest(tmp_path) == tmp_path / "checkpoints" / "step_2"
    assert [p.name for p in checkpoint.completed(tmp_path)] == ["step_2"]
    log = io.StringIO()
    removed = checkpoint.discard_partial(tmp_path, "resume", log)
    assert sorted(removed) == sorted([cut.name, early.name])
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2"]
    assert checkpoint.discard_partial(tmp_path, "resume", log) == []  # nothing left to remove, nothing said
    line = log.getvalue()
    assert line.startswith("resume: removed 2 checkpoint(s) cut short: .tmp-") and line.count("\n") == 1


def test_only_partial_checkpoints_anywhere_is_one_line_for_resume(tmp_path):
    checkpoint.begin(tmp_path)
    with pytest.raises(ConfigError, match=r"^--resume: '.*' has no checkpoint \(no checkpoints/step_N folder\)$"):
        checkpoint.latest(tmp_path)
    assert checkpoint.discard_partial(tmp_path / "elsewhere", "resume") == []  # a run that never checkpointed


def test_a_kill_while_a_checkpoint_replaces_its_step_never_leaves_a_partial_step_folder(tmp_path, monkeypatch):
    """A run that goes back (a recovery, a resume) re-writes step_N over the old one. Removing the old
    folder in place, a kill half-way through left a `step_N` with its run state but without its
    weights, which a resume picked; the old one is now renamed aside before it goes."""
    write(tmp_path, 2, b"old")
    real_rmtree = shutil.rmtree

    def killed_half_way(path, ignore_errors=False):
        real_rmtree(Path(path) / "model")  # the weights went first, then the process died
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_half_way)
    with pytest.raises(KeyboardInterrupt):
        write(tmp_path, 2, b"new")
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real_rmtree)
    found = checkpoint.latest(tmp_path)
    assert (found / "model" / "model.safetensors").read_bytes() == b"new"
    assert checkpoint.load_state(found).step == 2
    assert len(checkpoint.discard_partial(tmp_path, "resume", io.StringIO())) == 1  # the old one, renamed aside
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_2"]
