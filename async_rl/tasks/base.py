"""The Task interface and the loader for `task.name` (built-in name or 'pkg.module:factory')."""

from __future__ import annotations

import abc
import importlib
from collections.abc import Awaitable, Callable, Iterator

from async_rl.errors import ConfigError
from async_rl.protocol import Prompt, Sample


class Task(abc.ABC):
    """A verifiable task. `prompts` runs in the buffer (admission control leases them); `reward` runs
    in the reward worker processes of every generator engine, under a timeout. A task is rebuilt by
    name in each of those processes (`load_task`), never pickled."""

    name: str = "task"

    @abc.abstractmethod
    def prompts(self, seed: int) -> Iterator[Prompt]:
        """An endless (or long) stream of prompts with unique `prompt_id`s."""

    @abc.abstractmethod
    def reward(self, sample: Sample) -> float | Awaitable[float]:
        """Score one finished completion (`sample.prompt` holds the answer and metadata); a finite
        float, higher is better. May be `async def` (remote reward models, sandboxes)."""


def _builtin_factories() -> dict[str, Callable[[], Task]]:
    from async_rl.tasks.modsum import ModSumTask
    from async_rl.tasks.repeat import RepeatTask

    return {"repeat": RepeatTask, "modsum": ModSumTask}


BUILTIN_TASKS = ("repeat", "modsum")


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
    builtins = _builtin_factories()
    if name in builtins:
        return builtins[name]()
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
