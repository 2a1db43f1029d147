"""A write that fails for lack of space, or because its place is read-only or gone, is told apart and said
in one line (async_rl/storage.py), and a checkpoint that does not fit stops the run without touching the
last complete one."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from async_rl import storage
from async_rl.control import checkpoint
from tests.unit.test_checkpoint_partial import write

REPO = Path(__file__).resolve().parents[2]


def test_full_disk_writes_are_told_apart_on_a_real_full_filesystem(tmp_path):
    """The buffer's snapshot, a metrics record, torch.save, safetensors and a plain write into a 64 KiB tmpfs mounted in a mount namespace of
    our own (unshare), so nothing outside the test sees it."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare: cannot make a small filesystem of our own")
    mnt = tmp_path / "small"
    mnt.mkdir()
    script = f"mount -t tmpfs -o size=64k tmpfs {mnt} && exec {sys.executable} -m tests.unit._disk_full_probe {mnt}"
    for flags in (["-m"], ["-rm"]):  # root, else an unprivileged user namespace
        proc = subprocess.run(["unshare", *flags, "sh", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
        if proc.returncode == 0:
            break
    else:
        pytest.skip(f"cannot mount a tmpfs in a namespace here: {proc.stderr.strip()[-200:]}")
    results = {r["write"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert set(results) == {"buffer snapshot", "metrics.jsonl", "torch.save", "safetensors", "python"}
    for name, r in results.items():
        assert r["failed"] and r["out_of_space"], f"{name}: {r.get('error', 'did not fail')}"
        assert "no space left" in r["line"] and " free" in r["line"] and "\n" not in r["line"]
        if name not in ("metrics.jsonl", "buffer snapshot"):
            assert "256.0 KiB (262144 bytes)" in r["line"]
    # the buffer keeps serving and keeps its previous snapshot; the line names the file and its bytes
    assert results["buffer snapshot"]["line"].startswith(f"buffer snapshot: no space left on the device of {mnt}/")
    # the run's own metrics write stops it with its own line: which record, the file, the bytes
    assert results["metrics.jsonl"]["line"].startswith(f"metrics step 3: no space left on the device of {mnt}/metrics.jsonl: needs about ")


def test_other_failures_are_not_called_a_full_disk():
    assert not storage.out_of_space(OSError(errno.EACCES, "Permission denied"))
    assert not storage.out_of_space(RuntimeError("CUDA out of memory"))
    wrapped = RuntimeError("rank 0 failed")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert storage.out_of_space(wrapped)


def test_a_checkpoint_that_does_not_fit_stops_with_one_line_and_keeps_the_last(tmp_path):
    kept = write(tmp_path, 4, weights=b"w" * 4096)
    tmp = checkpoint.begin(tmp_path)
    (tmp / "partial").write_bytes(b"x" * 100)
    err = checkpoint.out_of_space(tmp_path, tmp, 6)
    line = str(err)
    assert "\n" not in line and line.startswith("checkpoint step_6: no space left")
    assert f"{storage.folder_bytes(kept)} bytes" in line and "free" in line and f"--resume {tmp_path} (from step_4)" in line
    assert not tmp.exists() and checkpoint.choose(tmp_path) == kept  # the partial folder freed, the last intact


def test_a_run_about_to_fill_its_disk_says_so_a_checkpoint_ahead(tmp_path, monkeypatch):
    assert checkpoint.space_warning(tmp_path, 2) is None  # nothing written yet: nothing to go by
    newest = write(tmp_path, 2, weights=b"w" * 8192)
    size = storage.folder_bytes(newest)
    for free, expected in ((3 * size, None), (size + size // 2, "the one after it may not"), (size // 2, "may not fit")):
        monkeypatch.setattr(storage, "free_bytes", lambda path, free=free: free)
        line = checkpoint.space_warning(tmp_path, 4)
        if expected is None:
            assert line is None
            continue
        assert line.startswith("checkpoint step_4: ") and expected in line and "\n" not in line
        assert f"({free} bytes) free" in line and f"(step_2) takes {size / 2**10:.1f} KiB ({size} bytes)" in line


def _in_a_mount_namespace(script: str) -> subprocess.CompletedProcess:
    """`script` (sh) in a mount namespace of our own (root, else an unprivileged user namespace): nothing
    outside the test sees what it mounts. Skips where none can be made."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare: cannot make a filesystem of our own")
    for flags in (["-m"], ["-rm"]):
        proc = subprocess.run(["unshare", *flags, "sh", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
        if proc.returncode == 0:
            return proc
    pytest.skip(f"cannot mount a tmpfs in a namespace here: {proc.stderr.strip()[-200:]}")


def test_a_checkpoint_into_a_read_only_run_directory_stops_with_one_line(tmp_path):
    mnt = tmp_path / "run"
    mnt.mkdir()
    proc = _in_a_mount_namespace(f"mount -t tmpfs -o size=1m tmpfs {mnt} && exec {sys.executable} -m tests.unit._read_only_probe {mnt}")
    assert proc.stdout.strip() == (
        f"checkpoint step_6: the run directory {mnt} is on a read-only filesystem; make it writable, then "
        f"--resume {mnt} (from step_4)"
    ), proc.stdout + proc.stderr


def test_a_place_that_is_gone_or_read_only_is_told_from_a_writable_one(tmp_path):
    assert storage.place_problem(tmp_path) is None and list(tmp_path.iterdir()) == []  # the probe file went
    gone = tmp_path / "run"
    gone.mkdir()
    shutil.rmtree(gone)
    assert storage.place_problem(gone) == "is gone (removed, or its filesystem unmounted)"
    line = str(checkpoint.unwritable(gone, gone / "checkpoints" / ".tmp-x", 3, storage.place_problem(gone)))
    assert line == f"checkpoint step_3: the run directory {gone} is gone (removed, or its filesystem unmounted); " \
                   "no checkpoint of this run is left there"


def test_a_buffer_snapshot_whose_folder_vanished_says_so(tmp_path):
    from async_rl.buffer.actor import BufferSettings, ReplayBuffer

    folder = tmp_path / "run"
    folder.mkdir()
    buf = ReplayBuffer(BufferSettings(
        run_id="r", host="127.0.0.1", ingest_port=0, serve_port=0, max_lag=1, prompts_per_step=2, group_size=2,
        filter_uniform_groups=False, max_frame_bytes=1 << 20, task_name="repeat", task_seed=0,
        snapshot_path=str(folder / "buffer.snapshot"),
    ))
    buf.save_snapshot()
    assert buf.stats().storage_error == ""
    shutil.rmtree(folder)  # the run directory removed under the running buffer
    buf.save_snapshot()
    assert buf.stats().storage_error == f"buffer snapshot {folder / 'buffer.snapshot'}: its folder is gone (removed, or its filesystem unmounted)"


def test_a_run_directory_that_cannot_be_made_stops_the_launch_in_one_line(tmp_path):
    from async_rl.config import load_config
    from async_rl.errors import RunError
    from async_rl.launch import _run_dir

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")  # root writes anywhere: a file in the path fails for root too
    cfg = load_config(None, [f"logging.run_dir={blocker / 'runs'}", "logging.run_name=r"])
    with pytest.raises(RunError) as err:
        _run_dir(cfg, None)
    assert str(err.value) == f"logging.run_dir: cannot write the run directory under {blocker / 'runs'}: Not a directory"
