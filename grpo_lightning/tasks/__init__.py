"""Built-in tasks: datasets made locally, with no download, each a ``DatasetDict`` with ``train`` and ``test`` splits.

Every task has a ``prompt`` column (the text the policy continues) and an ``answer`` column (the reference the
reward functions check against); tasks may add more columns, which reach the reward functions as keyword
arguments. Register a task with ``@register_task("name")``; the DataModule's ``dataset`` setting takes its name.
A ``family:task`` name (``reasoning_gym:basic_arithmetic``) is made by its family's module (``reasoning_gym.py``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from datasets import DatasetDict

TaskFactory = Callable[..., DatasetDict]

_TASKS: dict[str, TaskFactory] = {}

# Modules that register built-in tasks; imported on first use so that importing the package stays cheap.
_BUILTIN_MODULES = tuple(
    f"grpo_lightning.tasks.{name}" for name in ("arithmetic", "countdown", "gsm8k", "math", "multiplication")
) + ("grpo_lightning.integrations.vision.tasks",)
# Task families: ``family:task`` names made by a module of their own (its ``load(task, curriculum=, **kwargs)``),
# imported only when a config names one: the package behind it is an optional extra.
_FAMILIES = {"reasoning_gym": "grpo_lightning.integrations.reasoning_gym.tasks"}


def _family(name: str) -> tuple[str, str] | None:
    """``(module, task)`` of a ``family:task`` name, or None."""
    family, colon, task = name.partition(":")
    return (_FAMILIES[family], task) if colon and family in _FAMILIES else None


def register_task(name: str) -> Callable[[TaskFactory], TaskFactory]:
    """Decorator: make a ``DatasetDict`` factory available as ``dataset: name`` in YAML."""

    def decorator(factory: TaskFactory) -> TaskFactory:
        _TASKS[name] = factory
        return factory

    return decorator


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def available_tasks() -> list[str]:
    """Names of the built-in tasks."""
    _load_builtins()
    return sorted(_TASKS)


def is_task(name: str) -> bool:
    """``name`` is a built-in task, or a ``family:task`` name (``reasoning_gym:basic_arithmetic``)."""
    if _family(name) is not None:
        return True
    _load_builtins()
    return name in _TASKS


def load_task(name: str, *, curriculum: bool = False, **kwargs: object) -> DatasetDict:
    """Build the built-in task ``name`` (keyword arguments are the task's own options). ``curriculum``: the run
    draws prompts by pass rate (``data.curriculum``); a family task with difficulty levels then makes rows of every
    level (a ``level`` column); the other tasks ignore it."""
    family = _family(name)
    if family is not None:
        module, task = family
        return importlib.import_module(module).load(task, curriculum=curriculum, **kwargs)
    _load_builtins()
    if name not in _TASKS:
        raise KeyError(f"unknown task {name!r}; built-in tasks: {', '.join(sorted(_TASKS))}")
    return _TASKS[name](**kwargs)
