"""An error raised in another process (a Ray actor, the engine core behind it) as one line a user can
act on: the remote exception itself, not Ray's wrapping of it.

str() of a RayTaskError is the remote traceback, whose first line is the actor's process title
("ray::GeneratorEngine.start() (pid=..., ip=...)"); the exception the actor raised is its `cause`.
An actor whose process died has no exception of its own: Ray's message says how it died (killed by
ray.kill, its worker exited, the node died), which is what the line keeps."""

from __future__ import annotations

from async_rl.errors import first_line, typed_line

_DIED = "its process died"


def cause_line(exc: BaseException, limit: int = 300) -> str:
    """The root cause of `exc` in one line of at most about `limit` characters; an exception raised in
    this process: its first line, as before."""
    from ray.exceptions import OutOfMemoryError, RayActorError, RayTaskError

    if isinstance(exc, RayTaskError) and isinstance(exc.cause, BaseException) and exc.cause is not exc:
        cause = exc.cause
        if isinstance(cause, RayTaskError | RayActorError):  # a call the remote process made failed in turn
            return cause_line(cause, limit)
        # async_rl's own errors are written as lines for the user; a library's needs its type to be read
        return first_line(cause, limit) if type(cause).__module__.startswith("async_rl") else typed_line(cause, limit)
    if isinstance(exc, OutOfMemoryError):
        return f"{_DIED}: Ray's memory monitor killed it (the machine ran out of memory)"
    if isinstance(exc, RayActorError):
        return _actor_died(str(exc), exc.actor_init_failed, limit)
    return first_line(exc, limit)


def _actor_died(text: str, init_failed: bool, limit: int) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if init_failed and lines:  # the creation task's traceback: its last line is the exception raised
        return f"its constructor failed: {lines[-1][:limit]}"
    # Ray's lines: the base message, tab-indented facts (class_name, pid, ...), then how it died.
    how = [line for line in lines[1:] if ":" not in line.split(" ", 1)[0]]
    return f"{_DIED}: {how[0][:limit]}" if how else f"{_DIED} ({first_line(Exception(text), limit)})"
