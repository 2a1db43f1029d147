"""What a killed launcher leaves: its processes carry its mark; the next launch stops those whose
launcher is gone (and only those), in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from async_rl.control import leftovers

# A stand-in launcher: marks itself as `leftovers.marked` does, starts a child that ignores SIGTERM (as
# Ray's agents do), prints the child's pid and waits.
LAUNCHER = """
import os, subprocess, sys, time
from async_rl.control import leftovers
with leftovers.marked():
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
    print(child.pid, flush=True)
    time.sleep(300)
"""


def start_launcher() -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    p = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True, env=env)
    return p, int(p.stdout.readline())


def test_a_killed_launchers_processes_are_stopped_and_a_live_ones_are_not():
    live, live_child = start_launcher()
    dead, orphan = start_launcher()
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait(timeout=10)
        assert psutil.pid_exists(orphan)  # outlives its launcher
        found = [p.pid for p in leftovers.find_orphans()]
        assert orphan in found and live_child not in found and live.pid not in found
        line = leftovers.stop_orphans()
        assert line is not None and "\n" not in line and f"{orphan} python" in line and line.startswith("stopped ")
        deadline = time.monotonic() + 10
        while psutil.pid_exists(orphan) and psutil.Process(orphan).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the orphan is still running"
            time.sleep(0.05)
        assert psutil.Process(live_child).is_running()  # its launcher lives: not an orphan
        again = leftovers.stop_orphans()
        assert again is None or f"{live_child} " not in again
    finally:
        for pid in (live_child, orphan):
            if psutil.pid_exists(pid):
                psutil.Process(pid).kill()
        live.kill()
        live.wait(timeout=10)


def test_the_mark_is_set_only_inside_marked():
    assert leftovers.MARK_ENV not in os.environ
    with leftovers.marked() as mark:
        assert os.environ[leftovers.MARK_ENV] == mark and f":{os.getpid()}:" in mark
    assert leftovers.MARK_ENV not in os.environ
