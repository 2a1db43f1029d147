"""The base of every section: a field's description and constraints, the section type, the device choice."""

from __future__ import annotations

from typing import Any, Literal

import msgspec


def _f(description: str, **constraints: Any) -> msgspec.Meta:
    return msgspec.Meta(description=description, **constraints)


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


Device = Literal["auto", "cuda", "cpu"]
DEVICE_AUTO = "auto: cuda when the Ray cluster offers GPUs (a local Ray: this machine's), else cpu"
