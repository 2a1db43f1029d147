"""Run untrusted Python (a model's code-tool call) in a separate process with hard limits.

One process per call: CPU time (RLIMIT_CPU), address space (RLIMIT_AS), output size (stdout and
stderr go to files capped by RLIMIT_FSIZE, so a flood kills the process instead of our memory), open
files (set by util-linux `prlimit`, which execs the interpreter; without it, between fork and exec),
and a wall-clock timeout after which its whole process group (its own session) is killed. No network: the
process runs in a fresh network namespace (`unshare --net`, with a user namespace when not root)
where only an unconfigured loopback exists; where namespaces cannot be made, `network` reports
'socket-stub' and a prelude removes the socket module (weaker: documented, and reported by
`network_isolation()`). Interpreter in isolated mode (-I): no user site, no PYTHON* variables.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Literal

import msgspec

NetworkIsolation = Literal["namespace", "socket-stub"]

# Used only where a network namespace cannot be made: the code cannot import a working socket.
_SOCKET_STUB = (
    "import sys as _s\n"
    "class _NoNet:\n"
    "    def __getattr__(self, name):\n"
    "        raise OSError('network access is disabled in the sandbox')\n"
    "_s.modules['socket'] = _NoNet(); _s.modules['_socket'] = _NoNet(); del _s, _NoNet\n"
)


class SandboxLimits(msgspec.Struct, frozen=True, kw_only=True):
    wall_s: float = 5.0  # killed (with its process group) after this long
    cpu_s: int = 3  # RLIMIT_CPU: SIGXCPU/SIGKILL past this much CPU time
    memory_mb: int = 512  # RLIMIT_AS
    output_bytes: int = 16_384  # RLIMIT_FSIZE on the stdout/stderr files; the model sees at most this


class SandboxResult(msgspec.Struct, frozen=True):
    stdout: str
    stderr: str
    exit_code: int  # negative: killed by that signal
    timed_out: bool  # killed at the wall-clock limit
    wall_s: float
    output_truncated: bool = False  # stdout or stderr reached the output limit

    @property
    def outcome(self) -> str:
        """'ok', 'error', 'timeout', 'cpu_limit', 'output_limit' or 'killed' (a short counter key)."""
        if self.timed_out:
            return "timeout"
        if self.exit_code == -signal.SIGXCPU:
            return "cpu_limit"
        if self.output_truncated or self.exit_code == -signal.SIGXFSZ:
            # Python ignores SIGXFSZ: a write past RLIMIT_FSIZE fails with EFBIG instead.
            return "output_limit"
        if self.exit_code < 0:
            return "killed"
        return "ok" if self.exit_code == 0 else "error"


@functools.cache
def network_isolation() -> NetworkIsolation:
    """How this machine keeps sandboxed code off the network (probed once)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "socket-stub"
    for args in (_unshare_args(unshare, root=os.geteuid() == 0),):
        try:
            ok = subprocess.run([*args, "true"], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return "namespace"
    return "socket-stub"


def _unshare_args(unshare: str, root: bool) -> list[str]:
    # Not root: a user namespace (mapped to root inside) lets an unprivileged process make the
    # network namespace.
    return [unshare, "--net"] if root else [unshare, "--net", "--map-root-user"]


def _rlimits(limits: SandboxLimits) -> dict[int, tuple[int, int]]:
    mem = limits.memory_mb * 1024 * 1024
    return {
        resource.RLIMIT_CPU: (limits.cpu_s, limits.cpu_s + 1),
        resource.RLIMIT_AS: (mem, mem),
        resource.RLIMIT_FSIZE: (limits.output_bytes, limits.output_bytes),
        resource.RLIMIT_NOFILE: (64, 64),
        resource.RLIMIT_CORE: (0, 0),
    }


_PRLIMIT_FLAGS = {
    resource.RLIMIT_CPU: "--cpu",
    resource.RLIMIT_AS: "--as",
    resource.RLIMIT_FSIZE: "--fsize",
    resource.RLIMIT_NOFILE: "--nofile",
    resource.RLIMIT_CORE: "--core",
}


def _prlimit_args(prlimit: str, limits: SandboxLimits) -> list[str]:
    """util-linux `prlimit`: sets the limits, then execs the command."""
    return [prlimit, *(f"{_PRLIMIT_FLAGS[r]}={soft}:{hard}" for r, (soft, hard) in _rlimits(limits).items()), "--"]


def _limit(limits: SandboxLimits) -> None:  # runs in the child between fork and exec (no prlimit only)
    for r, pair in _rlimits(limits).items():
        resource.setrlimit(r, pair)


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` with `python -I` under `limits`; never raises for anything the code does."""
    limits = limits or SandboxLimits()
    isolation = network_isolation()
    with tempfile.TemporaryDirectory(prefix="async_rl_sandbox_") as tmp:
        script = os.path.join(tmp, "main.py")
        with open(script, "w") as f:
            f.write((_SOCKET_STUB if isolation == "socket-stub" else "") + code)
        cmd = [sys.executable, "-I", script]
        # The limits are set by `prlimit` (exec'd in the child) rather than Python code between fork
        # and exec: the caller is a threaded engine process, where preexec_fn may deadlock the child.
        prlimit = shutil.which("prlimit")
        if prlimit is not None:
            cmd = [*_prlimit_args(prlimit, limits), *cmd]
        if isolation == "namespace":
            cmd = [*_unshare_args(shutil.which("unshare") or "unshare", os.geteuid() == 0), *cmd]
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        t0 = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=tmp,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                start_new_session=True,  # its own process group: killed as a whole at the wall limit
                preexec_fn=None if prlimit else functools.partial(_limit, limits),  # noqa: PLW1509
            )
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)  # the group: children the code forked die too
                proc.wait()
        wall = time.monotonic() - t0
        return SandboxResult(
            stdout=_read_capped(out_path, limits.output_bytes),
            stderr=_read_capped(err_path, limits.output_bytes),
            exit_code=proc.returncode,
            timed_out=timed_out,
            wall_s=wall,
            output_truncated=max(os.path.getsize(out_path), os.path.getsize(err_path)) >= limits.output_bytes,
        )


def _read_capped(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")
