"""Operator requests to a running controller, through files in the run directory.

    RUN_DIR/control.json                the running controller: run id, pid, host (absent = not running)
    RUN_DIR/control/requests/ID.json    a request (written by `python -m async_rl.control.scale`)
    RUN_DIR/control/replies/ID.json     the controller's reply to it

Every file is written atomically (temporary file, then rename) and is a typed msgspec document, so a
reader never sees half a request. The controller reads requests between optimizer steps. Files work
the same on one machine and on a shared run directory, and need no open port.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path

import msgspec

CONTROL_SCHEMA = 1
ENDPOINT_NAME = "control.json"


class ControlEndpoint(msgspec.Struct, frozen=True):
    """Written by the controller when it is ready; removed when it stops."""

    schema: int
    run_id: str
    pid: int
    host: str
    started_at: float


class ScaleRequest(msgspec.Struct, frozen=True):
    schema: int
    request_id: str
    engines: int  # the generator pool size wanted


class ScaleReply(msgspec.Struct, frozen=True):
    request_id: str
    ok: bool
    engines_before: int
    engines_after: int
    message: str


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _dirs(run_dir: Path) -> tuple[Path, Path]:
    return run_dir / "control" / "requests", run_dir / "control" / "replies"


class ControlInbox:
    """The controller's side."""

    def __init__(self, run_dir: Path, run_id: str) -> None:
        self.run_dir = run_dir
        self.requests, self.replies = _dirs(run_dir)
        self.requests.mkdir(parents=True, exist_ok=True)
        self.replies.mkdir(parents=True, exist_ok=True)
        endpoint = ControlEndpoint(
            schema=CONTROL_SCHEMA, run_id=run_id, pid=os.getpid(), host=socket.gethostname(), started_at=time.time()
        )
        write_atomic(run_dir / ENDPOINT_NAME, msgspec.json.encode(endpoint))

    def poll(self) -> list[ScaleRequest | ScaleReply]:
        """Requests waiting, oldest first. A file that does not decode is answered with an error
        reply (returned as such, already written) and removed: it never blocks the ones after it."""
        out: list[ScaleRequest | ScaleReply] = []
        for path in sorted(self.requests.glob("*.json"), key=lambda p: p.stat().st_mtime):
            request_id = path.stem
            try:
                req = msgspec.json.decode(path.read_bytes(), type=ScaleRequest)
                if req.schema != CONTROL_SCHEMA:
                    raise msgspec.ValidationError(f"schema {req.schema}, want {CONTROL_SCHEMA}")
                out.append(req)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                reply = ScaleReply(request_id, False, 0, 0, f"request {path.name} is not a valid ScaleRequest: {exc}")
                self.answer(reply)
                out.append(reply)
            path.unlink(missing_ok=True)
        return out

    def answer(self, reply: ScaleReply) -> None:
        write_atomic(self.replies / f"{reply.request_id}.json", msgspec.json.encode(reply))

    def close(self) -> None:
        (self.run_dir / ENDPOINT_NAME).unlink(missing_ok=True)


class NotRunning(RuntimeError):
    pass


def read_endpoint(run_dir: Path) -> ControlEndpoint:
    """The running controller of `run_dir`, or NotRunning with the reason."""
    path = run_dir / ENDPOINT_NAME
    if not run_dir.is_dir():
        raise NotRunning(f"run directory '{run_dir}' does not exist")
    if not path.is_file():
        raise NotRunning(f"run '{run_dir}' is not running (no {ENDPOINT_NAME}: not started yet, or finished)")
    endpoint = msgspec.json.decode(path.read_bytes(), type=ControlEndpoint)
    if endpoint.host == socket.gethostname() and not _pid_alive(endpoint.pid):
        raise NotRunning(f"run '{run_dir}' is not running (its controller, pid {endpoint.pid}, is gone)")
    return endpoint


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def send_scale(run_dir: Path, engines: int, timeout_s: float, poll_s: float = 0.2) -> ScaleReply:
    """Ask the controller of `run_dir` for `engines` engines; wait for its reply."""
    read_endpoint(run_dir)
    requests, replies = _dirs(run_dir)
    request_id = f"{time.time_ns()}-{uuid.uuid4().hex[:8]}"
    write_atomic(
        requests / f"{request_id}.json",
        msgspec.json.encode(ScaleRequest(schema=CONTROL_SCHEMA, request_id=request_id, engines=engines)),
    )
    reply_path = replies / f"{request_id}.json"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if reply_path.is_file():
            reply = msgspec.json.decode(reply_path.read_bytes(), type=ScaleReply)
            reply_path.unlink(missing_ok=True)
            return reply
        try:
            read_endpoint(run_dir)
        except NotRunning as exc:
            (requests / f"{request_id}.json").unlink(missing_ok=True)
            raise NotRunning(f"{exc}; request {request_id} not answered") from None
        time.sleep(poll_s)
    (requests / f"{request_id}.json").unlink(missing_ok=True)  # withdrawn if not yet taken
    raise TimeoutError(
        f"no reply from the controller of '{run_dir}' within {timeout_s:.0f}s (it reads requests between "
        "steps; engines take a while to start)"
    )
