"""Processes a killed launcher left behind, found and stopped by the next launch on the machine.

A launcher killed by SIGKILL (an OOM kill, a lost session) cannot stop what it started; most of its
processes follow it (Ray's GCS and raylet share its fate, workers follow the raylet), but Ray's
dashboard and runtime-env agents ignore SIGTERM and outlive it by 30-90 s, and anything slower to
notice lingers too. So every launch marks its run's processes: the launcher puts MARK_ENV in its own
environment before it starts Ray, and every process of the run inherits it (Ray's processes, the
actors, vLLM's engine cores, reward workers). A mark names its launcher's pid. The next launch reads
the marks of the machine's processes, and SIGKILLs those whose launcher is gone (a dead pid, or a pid
now taken by a process without that mark), saying so in one line. psutil only; no Ray.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

MARK_ENV = "ASYNC_RL_LAUNCHER"  # value: "<host>:<launcher pid>:<its start time>:<random>"
GONE_TIMEOUT_S = 10.0


def new_mark() -> str:
    started = psutil.Process().create_time()
    return f"{socket.gethostname()}:{os.getpid()}:{started:.2f}:{uuid.uuid4().hex[:8]}"


@contextmanager
def marked() -> Iterator[str]:
    """While inside, processes this launcher starts carry its mark (inherited environment)."""
    mark = new_mark()
    before = os.environ.get(MARK_ENV)
    os.environ[MARK_ENV] = mark
    try:
        yield mark
    finally:
        if before is None:
            os.environ.pop(MARK_ENV, None)
        else:
            os.environ[MARK_ENV] = before


def _mark_of(proc: psutil.Process) -> str | None:
    try:
        return proc.environ().get(MARK_ENV)
    except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess, OSError):
        return None


def _launcher_alive(mark: str) -> bool:
    """Whether the launcher that made `mark` still runs: its pid, started at the recorded time (a pid
    taken since by another process is not it). /proc's environ shows a process's environment as it
    was at exec, so a launcher's own mark cannot be read back there."""
    parts = mark.split(":")
    if len(parts) != 4 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return True  # another machine's launcher (a shared environment) or a mark we did not write
    try:
        launcher = psutil.Process(int(parts[1]))
        return launcher.status() != psutil.STATUS_ZOMBIE and f"{launcher.create_time():.2f}" == parts[2]
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def find_orphans() -> list[psutil.Process]:
    """This machine's processes marked by a launcher that is gone (never this process or its own)."""
    own = os.environ.get(MARK_ENV)
    found, alive = [], {}
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        mark = _mark_of(proc)
        if mark is None or mark == own:
            continue
        if mark not in alive:
            alive[mark] = _launcher_alive(mark)
        if not alive[mark]:
            found.append(proc)
    return found


def stop_orphans() -> str | None:
    """SIGKILL what killed launchers left (they ignore SIGTERM); the one line saying so, or None."""
    orphans = find_orphans()
    if not orphans:
        return None
    names = []
    for proc in orphans:
        try:
            names.append(f"{proc.pid} {proc.name()}")
            proc.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    _, still = psutil.wait_procs(orphans, timeout=GONE_TIMEOUT_S)
    left = f"; {len(still)} would not stop: {[p.pid for p in still]}" if still else ""
    return (
        f"stopped {len(orphans) - len(still)} process(es) an earlier, killed launch left running "
        f"({', '.join(names[:6])}{', ...' if len(names) > 6 else ''}){left}"
    )
