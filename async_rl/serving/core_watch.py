"""Whether vLLM's engine-core process is still alive, seen from the process that started it.

vLLM's client learns of its core's exit on a monitor thread (a 1 s sentinel wait, then a shutdown of
the engine manager, then the client's `errored` flag). In a busy engine actor that thread can get its
turn 10-20 s late (measured on the 2-core machine, docs/faults.md), so waiting for the flag alone made
a dead core look alive that long. Here the core's pid is looked at directly: gone or a zombie is dead.
"""

from __future__ import annotations

import weakref

import psutil

from async_rl.serving.core_start import exit_words

# one entry per AsyncLLM: its engine-core processes, found once (the lookup walks vLLM's objects)
_cores: weakref.WeakKeyDictionary[object, list[psutil.Process]] = weakref.WeakKeyDictionary()


def core_pids(llm) -> list[int]:
    """The pids of the engine-core processes vLLM 0.32's AsyncLLM launched (its engine manager's
    `processes`); [] where this vLLM keeps them elsewhere (then only its `errored` flag tells)."""
    resources = getattr(getattr(llm, "engine_core", None), "resources", None)
    manager = getattr(resources, "engine_manager", None)
    return [p.pid for p in getattr(manager, "processes", None) or [] if getattr(p, "pid", None)]


def _processes(llm) -> list[psutil.Process]:
    try:
        return _cores[llm]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable: look it up every time
        return _lookup(llm)
    procs = _lookup(llm)
    if procs:  # none yet may mean not started yet: look again next time
        _cores[llm] = procs
    return procs


def _lookup(llm) -> list[psutil.Process]:
    out = []
    for pid in core_pids(llm):
        try:
            out.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            out.append(_Gone(pid))
    return out


class _Gone:
    """A core that had exited and been reaped before it was first looked at."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def is_running(self) -> bool:
        return False

    def status(self) -> str:
        return psutil.STATUS_DEAD


def exited_core(llm) -> int | None:
    """The pid of an engine-core process of `llm` that exited (gone, or a zombie not yet reaped), or
    None while every one runs. A pid reused by another process counts as exited (psutil compares the
    process's start time)."""
    for proc in _processes(llm):
        try:
            if not proc.is_running() or proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                return proc.pid
        except psutil.NoSuchProcess:
            return proc.pid
    return None


def exit_code(llm) -> int | None:
    """The exit code of an engine-core process of `llm` that exited, as multiprocessing reports it
    (negative: the signal that ended it), or None while every one runs or where it is not known."""
    resources = getattr(getattr(llm, "engine_core", None), "resources", None)
    manager = getattr(resources, "engine_manager", None)
    for proc in getattr(manager, "processes", None) or []:
        code = getattr(proc, "exitcode", None)  # a zombie is reaped by this look
        if isinstance(code, int):
            return code
    return None


def death_line(llm) -> str:
    """That vLLM's engine core died, and how where its exit code is known (SIGKILL: most often the
    out-of-memory killer; the kernel's log says which process it chose)."""
    code = exit_code(llm)
    return "vLLM's engine core died" + (f" ({exit_words(code)})" if code is not None else "")
