"""Tasks and other user callables by name: `load_task` for `task.name` (a built-in task, a
reasoning-gym dataset or 'pkg.module:factory'); any other 'pkg.module:attr' field is read by `load_callable` (config/loading.py)."""

from __future__ import annotations

from collections.abc import Callable

from async_rl.config.loading import load_callable
from async_rl.errors import ConfigError
from async_rl.tasks.base import Task
from async_rl.tasks.colour import ColourTask, blank_colour
from async_rl.tasks.modsum import ModSumTask
from async_rl.tasks.repeat import RepeatTask

_BUILTIN_FACTORIES: dict[str, Callable[[], Task]] = {
    "repeat": RepeatTask, "modsum": ModSumTask, "colour": ColourTask, "colour_blank": blank_colour,
}
BUILTIN_TASKS = tuple(_BUILTIN_FACTORIES)


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
