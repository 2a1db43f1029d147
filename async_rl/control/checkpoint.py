"""Run checkpoints: layout, atomic commit, retention, and finding the one to resume from.

    RUN_DIR/checkpoints/step_N/
        model/               HF folder (config, tokenizer, safetensors): from_pretrained and vLLM load it
        trainer_state.pt     optimizer, LR scheduler, step count (learner rank 0)
        rng_rank{r}.pt       every learner rank's RNG states
        run_state.json       step, policy version, buffer accounting and prompt stream position
        buffer_groups.msgpack  the groups generated but not yet trained (the resumed run trains them)
        manifest.json        every other file's size and xxh3 checksum, written last (checkpoint_manifest.py)

A checkpoint is written into a hidden temporary folder and renamed into place: a folder named
`step_N` is always complete, whenever the run was killed. A checkpoint cut short (a rank or the
controller killed while writing it) leaves its `.tmp-` folder behind; no resume or recovery reads one,
and `discard_partial` removes them (at a resume, after a learner recovery, at the next commit).

A resume or a learner recovery checks the checkpoint it picks against its manifest first (`pick`). A
damaged one (a file truncated, missing or changed after the commit) is renamed `damaged-step_N-*`,
which no later pick reads and retention never deletes, and the one before it is tried; a user can
still resume from it by naming its folder. `python -m async_rl.control.checkpoint verify RUN_DIR` checks
every checkpoint of a run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import TextIO

import msgspec

from async_rl import storage
from async_rl.buffer.actor import BufferState
from async_rl.control import checkpoint_manifest
from async_rl.errors import ConfigError, RunError

CHECKPOINTS = "checkpoints"
RUN_STATE = "run_state.json"
GROUPS_FILE = "buffer_groups.msgpack"  # the buffer's untrained groups (binary frames), beside run_state.json
_PREFIX = "step_"
_TMP = ".tmp-"
_DAMAGED = "damaged-"


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
    checkpoint_manifest.write(tmp)  # last: it describes every file written above
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


def out_of_space(run_dir: Path, tmp: Path, step: int) -> RunError:
    """Checkpoint `step` did not fit: its partial folder goes (it would only hold the space), and the
    run stops with one line naming the bytes needed (the newest checkpoint's size), the bytes free and
    the checkpoint to resume from, which stays intact."""
    shutil.rmtree(tmp, ignore_errors=True)
    found = completed(run_dir)
    needed = storage.folder_bytes(found[-1]) if found else None
    where = storage.space_line(f"checkpoint {_PREFIX}{step}", Path(run_dir) / CHECKPOINTS, needed)
    return RunError(f"{where}; {after_full_disk(run_dir)}")


def unwritable(run_dir: Path, tmp: Path, step: int, why: str) -> RunError:
    """Checkpoint `step` could not be written because the run directory is read-only or gone
    (storage.place_problem says which): one line naming it and what to resume from."""
    shutil.rmtree(tmp, ignore_errors=True)
    found = completed(run_dir)  # [] when the run directory is gone
    after = (f"make it writable, then --resume {run_dir} (from {found[-1].name})" if found
             else "no checkpoint of this run is left there")
    return RunError(f"checkpoint {_PREFIX}{step}: the run directory {run_dir} {why}; {after}")


def after_full_disk(run_dir: Path) -> str:
    """What a run stopped by a full disk says to do: free space and resume from its newest checkpoint."""
    found = completed(run_dir)
    return f"free space, then --resume {run_dir} (from {found[-1].name})" if found else "no checkpoint was written"


def space_warning(run_dir: Path, step: int) -> str | None:
    """Before checkpoint `step`: one line when the run directory's disk has room for fewer than two more
    checkpoints of the newest one's size (the older ones go only after the new one is complete), so a
    run about to fill its disk says so a checkpoint ahead. None when there is room or nothing to go by."""
    found = completed(run_dir)
    if not found:
        return None
    size = storage.folder_bytes(found[-1])
    root = Path(run_dir) / CHECKPOINTS
    free = storage.free_bytes(root)
    if free >= 2 * size:
        return None
    fits = "may not fit" if free < size else "fits, the one after it may not"
    return (f"checkpoint {_PREFIX}{step}: {storage.size_text(free)} free under {root}, the newest checkpoint "
            f"({found[-1].name}) takes {storage.size_text(size)}: this one {fits}")


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


def set_aside(ckpt: Path) -> Path:
    """Rename a damaged checkpoint so that no pick reads it again; never deleted (the user's to judge)."""
    aside = ckpt.parent / f"{_DAMAGED}{ckpt.name}-{uuid.uuid4().hex[:6]}"
    os.rename(ckpt, aside)
    return aside


def pick(run_dir: Path, when: str, stream: TextIO | None = None) -> Path | None:
    """The newest checkpoint of `run_dir` that its manifest vouches for (or that has no manifest, said in
    one line); each damaged one on the way is set aside, in one line naming its damaged file. None when
    no checkpoint is left. `when` starts each line (resume, recovery)."""
    out = stream or sys.stdout
    for ckpt in reversed(completed(run_dir)):
        verdict = checkpoint_manifest.verify(ckpt)
        if verdict.intact:
            if not verdict.verified:
                print(f"{when}: checkpoint {ckpt} has no manifest (written before manifests existed): "
                      "it loads unverified", file=out, flush=True)
            return ckpt
        aside = set_aside(ckpt)
        print(f"{when}: checkpoint {ckpt} is damaged: {verdict.damaged}; set aside as {aside.name}, "
              "trying the one before", file=out, flush=True)
    return None


def _is_checkpoint(path: Path) -> bool:
    return (path / RUN_STATE).is_file()


def resume_run_dir(path: Path) -> Path:
    """The run directory `--resume PATH` names: PATH itself, or the run of a checkpoint folder PATH
    (RUN_DIR/checkpoints/FOLDER); a one-line ConfigError when it does not exist or holds no checkpoint."""
    path = Path(path)
    if _is_checkpoint(path):
        return path.parent.parent
    if not path.is_dir():
        raise ConfigError(f"--resume: run directory '{path}' does not exist")
    if not completed(path):
        raise ConfigError(f"--resume: '{path}' has no checkpoint (no {CHECKPOINTS}/{_PREFIX}N folder)")
    return path


def choose(path: Path, stream: TextIO | None = None) -> Path:
    """The checkpoint `--resume PATH` resumes from: a checkpoint folder named explicitly is taken as it
    is (a damaged one with a warning line: the user chose it), a run directory's newest intact one
    (`pick`). A one-line ConfigError when none is left."""
    path = Path(path)
    out = stream or sys.stdout
    if _is_checkpoint(path):
        verdict = checkpoint_manifest.verify(path)
        if not verdict.intact:
            print(f"resume: warning: checkpoint {path}, chosen by name, is damaged: {verdict.damaged}",
                  file=out, flush=True)
        return path
    run_dir = resume_run_dir(path)
    found = pick(run_dir, "resume", out)
    if found is None:
        raise ConfigError(f"--resume: every checkpoint of '{run_dir}' is damaged (set aside as "
                          f"{CHECKPOINTS}/{_DAMAGED}*; name one's folder to resume from it anyway)")
    return found


def latest(run_dir: Path) -> Path:
    """The checkpoint folder `run_dir` names, else the run's newest complete checkpoint, unchecked; a
    one-line ConfigError when there is none."""
    return Path(run_dir) if _is_checkpoint(Path(run_dir)) else completed(resume_run_dir(run_dir))[-1]


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


def verify_run(run_dir: Path, stream: TextIO | None = None) -> int:
    """One line per checkpoint of `run_dir` (set-aside ones too): intact, damaged (and how) or
    unverified. Returns the number damaged."""
    out = stream or sys.stdout
    root = Path(run_dir) / CHECKPOINTS
    folders = sorted(p for p in root.iterdir() if _is_checkpoint(p)) if root.is_dir() else []
    if not folders:
        raise ConfigError(f"verify: '{run_dir}' has no checkpoint")
    damaged = 0
    for folder in folders:
        verdict = checkpoint_manifest.verify(folder)
        if not verdict.intact:
            damaged += 1
            line = f"damaged: {verdict.damaged}"
        else:
            line = "intact" if verdict.verified else "unverified (no manifest)"
        print(f"{folder.name}: {line}", file=out, flush=True)
    return damaged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m async_rl.control.checkpoint", description="Check a run's checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("verify", help="check every checkpoint of RUN_DIR against its manifest; exit 1 if any is damaged")
    check.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        return 1 if verify_run(args.run_dir) else 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
