"""The two kinds of user-facing failure, each with its exit code."""


class ConfigError(Exception):
    """Bad configuration: a one-line message naming the key; `launch` exits with code 2."""

    exit_code = 2


class RunError(Exception):
    """A run could not start or go on (missing model, port in use, dead process); exit code 1."""

    exit_code = 1
