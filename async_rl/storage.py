"""A write that failed for lack of space, or because its place is read-only or gone, told apart from
other failures and said in one line.

A full disk reaches us in three shapes, each seen on this stack (2026-12-06): an OSError with errno
ENOSPC (Python's own writes), safetensors' `I/O error: No space left on device (os error 28)`, and
torch.save's `[enforce fail at inline_container.cc:...] unexpected pos N vs M` (its zip writer notices
the short write, not the errno). A learner rank's failure arrives wrapped by Ray, so the test is on
the exception chain's messages as well as its errnos.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

_SIGNS = ("no space left on device", "os error 28", "unexpected pos ")


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__, getattr(e, "cause", None)]  # RayTaskError keeps the rank's as .cause
    return seen


def out_of_space(exc: BaseException) -> bool:
    """Whether `exc` (or what it wraps) is a write that failed because the device is full."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(sign in str(e).lower() for sign in _SIGNS):
            return True
    return False


def folder_bytes(path: Path) -> int:
    """The bytes of the files under `path` (0 when it does not exist)."""
    path = Path(path)
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def free_bytes(path: Path) -> int:
    """Bytes free on the filesystem holding `path` (its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def size_text(n: int) -> str:
    """A byte count for a line: MiB at 1 MiB and over, KiB below, the exact bytes beside it."""
    return f"{n / 2**20:.1f} MiB ({n} bytes)" if n >= 2**20 else f"{n / 2**10:.1f} KiB ({n} bytes)"


def space_line(what: str, path: Path, needed: int | None) -> str:
    """One line: `what` failed writing under `path` for lack of space, the bytes it needed (if known)
    and the bytes free there now."""
    need = f"needs about {size_text(needed)}" if needed else "needs an unknown amount"
    return f"{what}: no space left on the device of {path}: {need}, {size_text(free_bytes(path))} free"


def place_problem(folder: Path) -> str | None:
    """After a write into `folder` failed (not for space): what is wrong with the place itself, found by
    looking, not by reading error texts: it is gone (removed, or its filesystem unmounted), on a read-only
    filesystem, or not writable. None when a file can be made there (the failure was something else)."""
    folder = Path(folder)
    if not folder.is_dir():
        return "is gone (removed, or its filesystem unmounted)"
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-probe-")
    except OSError as exc:
        if exc.errno == errno.EROFS:
            return "is on a read-only filesystem"
        if exc.errno in (errno.EACCES, errno.EPERM):
            return "is not writable (permission denied)"
        if exc.errno == errno.ENOENT:
            return "is gone (removed, or its filesystem unmounted)"
        return None
    os.close(fd)
    os.unlink(probe)
    return None
