"""Reward functions: a registry by name, plus the scoring that combines them.

The contract every reward function follows (TRL's ``GRPOTrainer`` convention, so TRL's functions run unchanged)::

    fn(prompts, completions, **columns) -> list[float | None]   # or ``async def``

``columns`` are the dataset's other columns for the same rows (e.g. ``answer``), one value per completion, with
``completion_ids``, ``trainer_state``, ``log_metric`` and ``log_extra`` (``rewards/inputs.py``). A completion is
its text, or ``[{"role": "assistant", "content": text}]`` where its prompt is a conversation.
``None`` means "not applicable to this row" (multi-task data). A function may declare the dataset columns it
needs in a ``required_columns`` attribute; the DataModule checks them before training starts. ``kwargs`` of a
``RewardSpec`` are checked against the function's settings (``inputs.reward_settings``) when it is built.

Register a function with ``@register("name")``; YAML refers to it by that name or by an import path
(``my_pkg.rewards.fn``). The built-in rewards of the integrations (the sandbox's ``code_execution``,
``reasoning_gym``) are registered by path (``REWARD_PLUGINS``) and imported when a run names them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from grpo_lightning.plugins import load_plugin
from grpo_lightning.rewards.combine import RewardError, RewardSpec, check_required_columns, score

RewardFn = Callable[..., list]

_REGISTRY: dict[str, RewardFn] = {}

# name -> ``"module:attr"`` of the integrations' built-in rewards (``plugins.load_plugin``: imported when named).
REWARD_PLUGINS: dict[str, str] = {
    "code_execution": "grpo_lightning.integrations.sandbox.code:code_execution",
    "reasoning_gym": "grpo_lightning.integrations.reasoning_gym.rewards:reasoning_gym_reward",
}


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make a reward function available to configs as ``name`` (``data.rewards: [{name: ...}]``).

    The function follows the contract of the module docstring; the module that registers it must be imported before
    the config is read (or give the function's import path instead of a name).

    Args:
        name: the name configs give.

    Raises:
        ValueError: another function is registered as ``name`` already.
    """

    def decorator(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"a reward function is already registered as {name!r}")
        _REGISTRY[name] = fn
        return fn

    return decorator


def available() -> list[str]:
    """Names of the registered reward functions."""
    _load_builtins()
    return sorted({*_REGISTRY, *REWARD_PLUGINS})


def get(name: str) -> RewardFn:
    """The reward function a config names.

    Args:
        name: a registered name (``available()``), or an import path ``package.module.function``.

    Returns:
        The function, its ``kwargs`` not bound (``RewardSpec.build`` binds them).

    Raises:
        RewardError: the name is not registered, or the path does not import or is not callable (one line).
    """
    _load_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in REWARD_PLUGINS:
        return load_plugin(REWARD_PLUGINS[name])
    if "." in name:
        module_name, _, attr = name.rpartition(".")
        try:
            fn = load_plugin(f"{module_name}:{attr}")
        except (ImportError, AttributeError) as err:
            raise RewardError(f"reward {name!r} cannot be imported: {err}") from None
        if not callable(fn):
            raise RewardError(f"reward {name!r} is not callable")
        return fn
    raise RewardError(f"unknown reward {name!r}: use one of {', '.join(available())} or an import path")


def _load_builtins() -> None:
    # Imported lazily so that ``grpo_lightning.rewards`` stays importable without the optional pieces.
    importlib.import_module("grpo_lightning.rewards.builtin")


__all__ = [
    "REWARD_PLUGINS",
    "RewardError",
    "RewardSpec",
    "available",
    "check_required_columns",
    "get",
    "register",
    "score",
]
