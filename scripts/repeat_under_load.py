"""Run one pytest command several times in a row with CPU burners spinning throughout (the faults' bar:
the fault module 10 times in a row under two burners), and say how many runs passed.

    python scripts/repeat_under_load.py --runs 10 --burners 2 --log /tmp/faults-10x.log \
        -- tests/integration/test_faults.py -q

Each run's whole output goes to the log, with a line per run (start, seconds, outcome, the load
average) and a last summary line `N of M passed`; the burners are stopped through their handles.
Exit status: 0 when every run passed.

--burner-nice 15 runs the burners at the niceness Ray gives the run's workers (engines, learner ranks,
buffer): at the default 0 the kernel gives each burner ~28 times a worker's share of a core (weights
1024 and 36), so on 2 cores two burners starve the run itself (an engine took over 7 minutes to
start) rather than load the machine around it. A run past --timeout-s is stopped with its whole
process group (pytest runs in a session of its own, with the Ray processes it started). So is the
run going on when the script is stopped (SIGTERM or SIGINT; a background job has SIGINT ignored, so
use SIGTERM there): its process group is killed and the burners stopped before the script exits.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from _load import start_burners, stop_burners  # noqa: E402  (the tests' own burners)


def stamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S")


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds into main's cleanup: the run's process group, the burners


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--burners", type=int, default=2)
    ap.add_argument("--burner-nice", type=int, default=0, help="the burners' niceness (Ray's workers run at 15)")
    ap.add_argument("--timeout-s", type=float, default=1800, help="per run")
    ap.add_argument("--log", required=True)
    ap.add_argument("pytest_args", nargs="+", help="after --: what pytest runs")
    a = ap.parse_args(argv)
    log = Path(a.log)
    passed = 0
    with log.open("a") as out:
        def say(line: str) -> None:
            print(line, flush=True)
            out.write(line + "\n")
            out.flush()

        say(f"[{stamp()}] {a.runs} runs of pytest {' '.join(a.pytest_args)} under {a.burners} burners "
            f"at nice {a.burner_nice}")
        burners = start_burners(a.burners, nice=a.burner_nice)
        proc: subprocess.Popen | None = None
        i = 0
        signal.signal(signal.SIGTERM, _stop)
        try:
            for i in range(1, a.runs + 1):
                t0, load0 = time.monotonic(), os.getloadavg()[0]
                say(f"[{stamp()}] run {i} starts (load {load0:.1f})")
                proc = subprocess.Popen([sys.executable, "-m", "pytest", *a.pytest_args], cwd=ROOT, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
                try:
                    code = proc.wait(timeout=a.timeout_s)
                    outcome = "passed" if code == 0 else f"FAILED (exit {code})"
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)  # pytest and what it started (its session's group)
                    proc.wait()
                    outcome = f"TIMED OUT after {a.timeout_s:.0f} s"
                passed += outcome == "passed"
                say(f"[{stamp()}] run {i}: {outcome} in {time.monotonic() - t0:.0f} s (load now {os.getloadavg()[0]:.1f})")
        except KeyboardInterrupt:  # SIGINT, or SIGTERM through _stop
            say(f"[{stamp()}] stopped during run {i}")
            raise
        finally:
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            stop_burners(burners)
        say(f"[{stamp()}] {passed} of {a.runs} passed")
    return 0 if passed == a.runs else 1


if __name__ == "__main__":
    sys.exit(main())
