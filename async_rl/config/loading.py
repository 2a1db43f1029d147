"""YAML file + `section.key=value` overrides -> a validated `Config`; back to a dict or YAML; the reference rows."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import yaml

from async_rl.config.tree import Config
from async_rl.config.validation import validate
from async_rl.errors import ConfigError, first_line


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads '1e-3' (no dot) as a string; accept it as the float users mean. And it reads
    on/off/yes/no as booleans, so `recover: off` or `enforce_eager: on` would fail as "got bool":
    booleans are YAML 1.2's, true and false only."""


_BOOL = "tag:yaml.org,2002:bool"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _yaml(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


# Keys that moved: the old name gets one line naming the new one.
MOVED_KEYS = {"learner.megatron.device": "learner.device"}

_MSGSPEC_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`")
_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `(?P<name>[^`]+)`")


def _one_line(err: msgspec.ValidationError) -> str:
    """Turn msgspec's message ('... - at `$.learner.lr`') into 'learner.lr: ...'."""
    text = str(err)
    m = _MSGSPEC_PATH.search(text)
    path = m.group("path").lstrip(".") if m else ""
    text = _MSGSPEC_PATH.sub("", text)
    unknown = _UNKNOWN_FIELD.search(text)
    if unknown:
        key = f"{path}.{unknown.group('name')}" if path else unknown.group("name")
        if key in MOVED_KEYS:
            return f"config key '{key}' moved to '{MOVED_KEYS[key]}' (same values)"
        return f"unknown config key '{key}'"
    return f"config key '{path or '<root>'}': {text}"


def apply_override(tree: dict[str, Any], override: str) -> None:
    """Apply one `a.b.c=value` override; the value is parsed as YAML (so 3, true, [1, 2] work)."""
    if "=" not in override:
        raise ConfigError(f"override '{override}' is not of the form section.key=value")
    dotted, raw = override.split("=", 1)
    keys = dotted.strip().split(".")
    if not all(keys):
        raise ConfigError(f"override '{override}' has an empty key")
    try:
        value = _yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override '{override}': value is not valid YAML ({exc.__class__.__name__})") from None
    node = tree
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override '{override}': '{'.'.join(keys[: i + 1])}' is not a section")
        node = child
    node[keys[-1]] = value


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config, apply overrides, convert to typed Structs and check cross-field rules."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist")
        try:
            loaded = _yaml(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file '{p}' is not valid YAML: {first_line(exc, limit=500)}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file '{p}' must hold a mapping of sections at the top level")
        # An empty section ('learner:' with nothing under it) means "all defaults".
        tree = {k: ({} if v is None else v) for k, v in (loaded or {}).items()}
    for override in overrides:
        apply_override(tree, override)
    try:
        cfg = msgspec.convert(tree, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(_one_line(exc)) from None
    validate(cfg)
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def describe(struct_type: type[msgspec.Struct] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, description) for every leaf field: the config reference."""
    rows: list[tuple[str, str, str]] = []
    default = struct_type()
    for field in msgspec.structs.fields(struct_type):
        key = f"{prefix}{field.name}"
        value = getattr(default, field.name)
        if isinstance(value, msgspec.Struct):
            rows.extend(describe(type(value), key + "."))
            continue
        desc = ""
        for meta in getattr(field.type, "__metadata__", ()):
            if isinstance(meta, msgspec.Meta) and meta.description:
                desc = meta.description
        rows.append((key, repr(value), desc))
    return rows


def load_callable(field: str, name: str) -> Callable:
    """The callable a config field names as 'pkg.module:attr'; a one-line ConfigError naming `field`
    when the module does not import or has no such callable."""
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an import can fail with any error; name it in one line
        raise ConfigError(f"{field} '{name}' does not import: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ConfigError(f"{field} '{name}': module '{module_name}' has no callable '{attr}'")
    return fn
