"""A checkpoint's manifest: every file's size and checksum, so a damaged checkpoint is told from a good
one before anything loads it.

`manifest.json` is written last into the checkpoint's temporary folder, before the rename that makes
the checkpoint visible (checkpoint.commit). xxh3-64 (the `xxhash` package, already a dependency)
reads at memory speed, so a check costs about what reading the files costs. A checkpoint written
before manifests existed has none: it is `unverified`, and still loads.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import xxhash

MANIFEST = "manifest.json"
_CHUNK = 8 << 20


class FileEntry(msgspec.Struct, frozen=True):
    path: str  # relative to the checkpoint folder, '/'-separated
    size: int
    xxh3_64: str  # hex digest of the file's bytes


class Manifest(msgspec.Struct, kw_only=True):
    format: int = 1
    files: list[FileEntry]


class Verdict(msgspec.Struct, frozen=True):
    """What a check found. `damaged`: the first file that differs and how ('' when intact)."""

    checkpoint: str
    verified: bool  # False: no manifest (written before manifests existed)
    damaged: str = ""

    @property
    def intact(self) -> bool:
        return not self.damaged


def file_digest(path: Path) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write(folder: Path) -> Manifest:
    """Describe every file of `folder` in its manifest (call it when nothing else will be written)."""
    folder = Path(folder)
    entries = [FileEntry(p.relative_to(folder).as_posix(), p.stat().st_size, file_digest(p)) for p in _files(folder)]
    manifest = Manifest(files=entries)
    (folder / MANIFEST).write_bytes(msgspec.json.encode(manifest))
    return manifest


def verify(folder: Path) -> Verdict:
    """Check `folder` against its manifest: sizes first (cheap: a truncated copy fails at once), then
    checksums. A file the manifest does not list is not an error (a user's note beside the weights)."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        return Verdict(str(folder), verified=False)
    try:
        manifest = msgspec.json.decode(path.read_bytes(), type=Manifest)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return Verdict(str(folder), verified=True, damaged=f"{MANIFEST} unreadable ({e})")
    for entry in manifest.files:
        f = folder / entry.path
        if not f.is_file():
            return Verdict(str(folder), verified=True, damaged=f"{entry.path} missing")
        size = f.stat().st_size
        if size != entry.size:
            return Verdict(str(folder), verified=True, damaged=f"{entry.path} has {size} bytes, the manifest {entry.size}")
    for entry in manifest.files:
        if file_digest(folder / entry.path) != entry.xxh3_64:
            return Verdict(str(folder), verified=True, damaged=f"{entry.path} checksum differs from the manifest's")
    return Verdict(str(folder), verified=True)
