"""Verifiable tasks: a prompt stream and a reward function. Built-ins by name, user tasks by dotted path."""

from async_rl.tasks.base import Task
from async_rl.tasks.registry import load_task

__all__ = ["Task", "load_task"]
