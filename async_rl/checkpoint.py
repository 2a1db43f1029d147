"""Run checkpoints: layout, atomic commit, retention, and finding the one to resume from.

    RUN_DIR/checkpoints/step_N/
        model/               HF folder (config, tokenizer, safetensors): from_pretrained and vLLM load it
        trainer_state.pt     optimizer, LR scheduler, step count (learner rank 0)
        rng_rank{r}.pt       every learner rank's RNG states
        run_state.json       step, policy version, buffer accounting and prompt stream position
        buffer_groups.msgpack  the groups generated but not yet trained (the resumed run trains them)

A checkpoint is written into a hidden temporary folder and renamed into place: a folder named
`step_N` is always complete, whenever the run was killed. A checkpoint cut short (a rank or the
controller killed while writing it) leaves its `.tmp-` folder behind; no resume or recovery reads one,
and `discard_partial` removes them (at a resume, after a learner recovery, at the next commit).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import TextIO

import msgspec

from async_rl.buffer.actor import BufferState
from async_rl.errors import ConfigError

CHECKPOINTS = "checkpoints"
RUN_STATE = "run_state.json"
GROUPS_FILE = "buffer_groups.msgpack"  # the buffer's untrained groups (binary frames), beside run_state.json
_PREFIX = "step_"
_TMP = ".tmp-"


class RunCheckpoint(msgspec.Struct, kw_only=True):
    step: int  # optimizer steps done; the resumed run's first step index
    version: int  # policy version of the saved weights
    buffer: BufferState
    saved_at: float
    # The HF folder the run started from (its first run, not a resume): the KL reference. '' in
    # checkpoints written before it was recorded (a resume then falls back to model.path).
    initial_model_dir: str = ""


def begin(run_dir: Path) -> Path:
    """A fresh temporary folder for a checkpoint being written."""
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{_TMP}{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, state: RunCheckpoint, keep: int) -> Path:
    """Write the run state, rename `tmp` to `step_N`, drop all but the newest `keep` checkpoints."""
    # the groups' frames are binary: msgpack beside the readable JSON, not base64 inside it
    (tmp / GROUPS_FILE).write_bytes(msgspec.msgpack.encode(state.buffer.groups))
    readable = msgspec.structs.replace(state, buffer=msgspec.structs.replace(state.buffer, groups=[]))
    (tmp / RUN_STATE).write_bytes(msgspec.json.encode(readable))
    for f in tmp.rglob("*"):  # data on disk before the rename makes it visible
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    root = tmp.parent
    final = root / f"{_PREFIX}{state.step}"
    replaced = None
    if final.exists():  # a run resumed from an older checkpoint re-reaches this step: replace it
        # renamed aside first, never removed in place: a kill during rmtree would leave a `step_N`
        # that still holds its run_state.json but lacks some of its weights, which a resume would pick
        replaced = root / f"{_TMP}old-{uuid.uuid4().hex[:8]}"
        os.rename(final, replaced)
    os.rename(tmp, final)
    _fsync_dir(root)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    for old in completed(root.parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def discard_partial(run_dir: Path, when: str, stream: TextIO | None = None) -> list[str]:
    """Remove the `.tmp-` folders of checkpoints cut short (no writer may be running: call it when
    every learner rank that could write one is gone or idle) and, if any went, say so in one line on
    `stream` (stdout by default) starting with `when` (resume, recovery, commit). Returns the names
    removed."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    removed = []
    for p in sorted(root.iterdir()):
        if p.name.startswith(_TMP) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    if removed:
        line = f"{when}: removed {len(removed)} checkpoint(s) cut short: {', '.join(removed)}"
        print(line, file=stream or sys.stdout, flush=True)
    return removed


def completed(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX) :].isdigit():
            if (p / RUN_STATE).is_file():
                found.append(p)
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


def latest(run_dir: Path) -> Path:
    """The newest complete checkpoint of `run_dir`; a one-line ConfigError when there is none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"--resume: run directory '{run_dir}' does not exist")
    found = completed(run_dir)
    if not found:
        raise ConfigError(f"--resume: '{run_dir}' has no checkpoint (no {CHECKPOINTS}/{_PREFIX}N folder)")
    return found[-1]


def load_state(checkpoint: Path) -> RunCheckpoint:
    state = msgspec.json.decode((Path(checkpoint) / RUN_STATE).read_bytes(), type=RunCheckpoint)
    groups = Path(checkpoint) / GROUPS_FILE
    if groups.is_file():  # absent in checkpoints written before groups were kept
        state.buffer.groups = msgspec.msgpack.decode(groups.read_bytes(), type=list[list[bytes]])
    return state


def trim_metrics(run_dir: Path, step: int, name: str = "metrics.jsonl") -> int:
    """Keep the records of steps before `step` (the steps the checkpoint holds); steps the killed run
    logged after its last checkpoint are trained again, so their records go (eval.jsonl likewise: the
    resumed run evaluates step `step` again at its start). Returns how many went."""
    path = Path(run_dir) / name
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            dropped += 1  # a line torn by the kill
            continue
        if record_step < step:
            kept.append(line)
        else:
            dropped += 1
    tmp = path.with_suffix(f".tmp-{int(time.time())}")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return dropped
