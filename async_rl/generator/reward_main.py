"""Run the engine's main script once in the reward fork server, so its workers do not each run it.

multiprocessing starts every fork-server (or spawn) child by re-running the parent's main script as
`__mp_main__` when that main is a file, unless the child already has it. An engine's main is Ray's
`default_worker.py`, which imports ray: about 1.5 s of CPU for every reward worker started, on the
engine's own cores, at pool start and at the replacement of every timed-out or crashed worker. Under
load that starved the pool (workers starting for seconds while calls waited) until the watchdog judged
it wedged. `set_forkserver_preload(['__main__'])` is meant to run the main once in the fork server, but
CPython 3.11's fork server never receives the path (it keeps the key 'main_path' of data whose key is
'init_main_from_path'). So the runner puts the path in MAIN_PATH_ENV and preloads this module, which
runs the script in the server as multiprocessing would in a child; a child then finds `__main__`
loaded from that path and skips it."""

from __future__ import annotations

import os
import sys
from multiprocessing import spawn

MAIN_PATH_ENV = "ASYNC_RL_REWARD_MAIN_PATH"


def main_script_path() -> str | None:
    """The path multiprocessing would re-run in each child (None when the main is a module or absent),
    normalized as multiprocessing does."""
    main = sys.modules.get("__main__")
    if main is None or getattr(main.__spec__, "name", None) is not None:
        return None  # run as a module (python -m ...): children skip it
    path = getattr(main, "__file__", None)
    if path is None:
        return None
    if not os.path.isabs(path) and spawn.process.ORIGINAL_DIR is not None:
        path = os.path.join(spawn.process.ORIGINAL_DIR, path)
    return os.path.normpath(path)


def _load_in_fork_server() -> None:
    path = os.environ.get(MAIN_PATH_ENV)
    if path and getattr(sys.modules.get("__main__"), "__file__", None) != path:
        spawn.import_main_path(path)


if os.environ.get(MAIN_PATH_ENV) and "multiprocessing.forkserver" in sys.modules and sys.argv[:1] == ["-c"]:
    _load_in_fork_server()  # imported as a preload by the fork server (started with python -c)
