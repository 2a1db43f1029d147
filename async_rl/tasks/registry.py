"""Tasks and other user callables by name: `load_task` for `task.name` (a built-in task, a
reasoning-gym dataset or 'pkg.module:factory') and `load_callable` for any 'pkg.module:attr' field."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from async_rl.errors import ConfigError
from async_rl.tasks.base import Task
from async_rl.tasks.colour import ColourTask, blank_colour
from async_rl.tasks.modsum import ModSumTask
from async_rl.tasks.repeat import RepeatTask

_BUILTIN_FACTORIES: dict[str, Callable[[], Task]] = {
    "repeat": RepeatTask, "modsum": ModSumTask, "colour": ColourTask, "colour_blank": blank_colour,
}
BUILTIN_TASKS = tuple(_BUILTIN_FACTORIES)


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


def load_task(name: str) -> Task:
    """Built-in task by name, a reasoning-gym dataset 'reasoning_gym:<dataset>', or a user task from
    'pkg.module:factory' (factory() -> Task)."""
    if name in _BUILTIN_FACTORIES:
        return _BUILTIN_FACTORIES[name]()
    if name.startswith("reasoning_gym:"):
        from async_rl.tasks.reasoning_gym import ReasoningGymTask

        return ReasoningGymTask(name.removeprefix("reasoning_gym:"))
    if ":" not in name:
        raise ConfigError(
            f"task.name '{name}' is not a built-in task {BUILTIN_TASKS}, 'reasoning_gym:<dataset>' nor 'pkg.module:factory'"
        )
    factory = load_callable("task.name", name)
    try:
        task = factory()
    except Exception as exc:
        raise ConfigError(f"task.name '{name}': factory raised {type(exc).__name__}: {exc}") from None
    if not isinstance(task, Task):
        raise ConfigError(f"task.name '{name}': factory returned {type(task).__name__}, not an async_rl Task")
    return task
