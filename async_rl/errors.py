"""The two kinds of user-facing failure, each with its exit code."""


class ConfigError(Exception):
    """Bad configuration: a one-line message naming the key; `launch` exits with code 2."""

    exit_code = 2


class RunError(Exception):
    """A run could not start or go on (missing model, port in use, dead process); exit code 1."""

    exit_code = 1


def first_line(exc: BaseException, limit: int = 200) -> str:
    """An exception as one short line for a one-line error: the first line of its message, cut at `limit`
    characters, or its type's name where the message is empty. Library messages run to many lines (a
    template's traceback, pyarrow's schema dump); the user needs their first."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__


def typed_line(exc: BaseException, limit: int = 200) -> str:
    """`first_line` after the exception's type ("ValueError: ..."), for errors whose type says what went
    wrong (a number too long to convert, nesting too deep)."""
    return f"{type(exc).__name__}: {first_line(exc, limit)}" if str(exc).strip() else type(exc).__name__
