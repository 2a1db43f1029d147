"""Why vLLM's engine core failed to start, in one line a user can act on.

vLLM 0.32 makes its engine core in a child process. When that child fails during start, the process
that made the engine raises "Engine core initialization failed. See root cause above. Failed core
proc(s): {'EngineCore': -9}". The root cause (a KV cache that does not fit, weights that do not load)
was logged by the child on the stderr both processes share, which in a Ray actor is the actor's log
file, so "above" is nowhere the user looks. This module reads the cause back from that file (from
where it stood when the start began) and turns the child's exit code into words.
"""

from __future__ import annotations

import os
import re
import signal
import stat

CORE_FAILED = "Engine core initialization failed"
# A Python exception's last traceback line ("ValueError: ..."), after vLLM's optional process prefix
# ("(EngineCore_DP0 pid=123) "); vLLM's own summary line in the parent is not a cause.
# A traceback's lines may carry vLLM's logger prefix too ("ERROR 12-07 03:22:41 [core.py:1510] ").
_EXCEPTION = re.compile(
    r"^(?:\([^)]*\)\s+)?(?:[A-Z]+ \d\d-\d\d [\d:]+ \[[^\]]*\]\s+)?"
    r"((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit)\b:?.*)$"
)
_CODES = re.compile(r"Failed core proc\(s\): (\{[^}]*\})")
_CODE = re.compile(r"'([^']+)': (-?\d+)")
_READ_BACK = 256 << 10  # the child's traceback is near the end of what the start wrote


class EngineStartError(RuntimeError):
    """vLLM's engine core failed to start; the message says why (retried like any failed start)."""


def _stderr_is_a_file() -> bool:
    try:
        return stat.S_ISREG(os.fstat(2).st_mode)
    except OSError:
        return False


def stderr_offset() -> int:
    """Where this process's stderr file (a Ray actor's log) ends now: a later failure reads only what
    came after. 0 for a terminal or a pipe, which cannot be read back."""
    return os.fstat(2).st_size if _stderr_is_a_file() else 0


def read_since(offset: int) -> str:
    """What this process's stderr file got since `offset` (at most its last 256 KiB); '' where it is
    no file. Opened again through /proc: the file may have no name left (pytest's capture)."""
    if not _stderr_is_a_file():
        return ""
    try:
        with open("/proc/self/fd/2", "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(offset, size - _READ_BACK))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def cause_in_log(text: str) -> str | None:
    """The last exception line the engine core logged: its root cause."""
    found = None
    for line in text.splitlines():
        m = _EXCEPTION.match(line.strip())
        if m and CORE_FAILED not in m.group(1):
            found = m.group(1).strip()
    return found


def exit_words(code: int) -> str:
    """A child's exit code in words: a negative one is the signal that ended it."""
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"killed by signal {-code}"
    why = " (the out-of-memory killer, or a kill)" if -code == signal.SIGKILL else ""
    return f"killed by {name}{why}"


# vLLM names its own arguments; a user sets ours. Causes whose fix is one of our keys, by a phrase vLLM 0.32 uses.
_KEYS = (
    (("cache blocks", "KV cache"), "generators.kv_cache_gib (cpu), generators.gpu_memory_utilization (cuda), "
     "generators.max_model_len"),
    (("max_model_len", "max seq len"), "generators.max_model_len"),
)


def keys_for(cause: str) -> str:
    """The config keys that decide `cause`, as a suffix ('' when none does)."""
    for phrases, keys in _KEYS:
        if any(p in cause for p in phrases):
            return f" [async_rl: {keys}]"
    return ""


def explain(exc: BaseException, log_text: str, limit: int = 300) -> str | None:
    """One line for a failed engine start (None: not the engine core's failure to start)."""
    text = str(exc)
    if CORE_FAILED not in text:
        return None
    codes = _CODES.search(text)
    died = [f"{name} {exit_words(int(code))}" for name, code in _CODE.findall(codes.group(1))] if codes else []
    cause = cause_in_log(log_text)
    line = "vLLM's engine core failed to start"
    if cause:
        line += f": {cause[:limit]}{keys_for(cause)}"
    if died:
        line += f" ({', '.join(died)})" if cause else f": {', '.join(died)}"
    return line if cause or died else f"{line} (its log holds no cause)"
