"""Which config a resumed run goes on with (`launch --resume RUN_DIR [CONFIG] [overrides]`).

Without a CONFIG the run's own saved config is used (the newest of `config.yaml` and the
`config.resume-N.yaml` that earlier resumes wrote), with the overrides applied on top and named in one
line. With a CONFIG, the keys where it differs from the saved config are named in one line before the
run goes on; a different model is refused (the checkpoint's weights are another model's).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from async_rl.config import Config, load_config, to_dict
from async_rl.errors import ConfigError

SAVED = "config.yaml"
_RESUMED = re.compile(r"config\.resume-(\d+)\.yaml")
# Keys that do not change what the run trains: where it logs and which Ray it talks to.
_NOT_THE_RUN = ("logging.", "ray.")
# Keys a resume cannot go on with: the checkpoint holds this model's weights and optimizer state.
REFUSED = ("model.path",)


def saved_config(run_dir: Path) -> Path:
    """The config the run last ran with: its newest `config.resume-N.yaml`, else `config.yaml`."""
    resumed = [(int(m.group(1)), p) for p in Path(run_dir).glob("config.resume-*.yaml") if (m := _RESUMED.fullmatch(p.name))]
    if resumed:
        return max(resumed)[1]
    path = Path(run_dir) / SAVED
    if not path.is_file():
        raise ConfigError(f"--resume: '{run_dir}' has no saved {SAVED}: give the CONFIG it ran with")
    return path


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def changed_keys(saved: Config, given: Config) -> dict[str, tuple[Any, Any]]:
    """key -> (saved value, given value) for every key that changes the run."""
    a, b = _flat(to_dict(saved)), _flat(to_dict(given))
    keys = sorted(a.keys() | b.keys())
    return {k: (a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k) and not k.startswith(_NOT_THE_RUN)}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_given(saved_path: Path, saved: Config, given: Config) -> str | None:
    """One line naming the keys where CONFIG differs from the run's saved config (None: none differ);
    a one-line ConfigError where going on would be wrong. Both with their devices resolved alike."""
    diff = changed_keys(saved, given)
    for key in REFUSED:
        if key in diff:
            old, new = diff[key]
            raise ConfigError(
                f"--resume: {key} is {new!r} but the run was trained from {old!r} ({saved_path}): "
                "its checkpoint holds another model; resume without CONFIG or start a new run"
            )
    if not diff:
        return None
    keys = ", ".join(f"{k} {_short(old)} -> {_short(new)}" for k, (old, new) in diff.items())
    return f"resume: CONFIG differs from the run's saved config ({saved_path.name}) in {len(diff)} key(s): {keys}"


def saved_with_overrides(run_dir: Path, overrides: list[str]) -> tuple[Config, str]:
    """The run's own saved config with `overrides` on top, and the line that says so."""
    saved_path = saved_config(run_dir)
    on_top = f", with override(s) on top: {' '.join(overrides)}" if overrides else ""
    return load_config(saved_path, overrides), f"resume: the run's saved config {saved_path}{on_top}"


def split_positionals(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """`--resume RUN_DIR key=value ...` without a CONFIG: the first override lands in the CONFIG slot."""
    if config is not None and "=" in config and not Path(config).is_file():
        return None, [config, *overrides]
    return config, list(overrides)
