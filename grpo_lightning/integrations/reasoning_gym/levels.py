"""Difficulty levels of reasoning-gym tasks: how many a task's curriculum has, which levels a run's rows span, and
a mixture whose tasks make rows at levels of their own (``grpo_lightning/integrations/reasoning_gym/tasks.py`` builds
the rows).

A level's settings are the curriculum's for it (``grpo_lightning.integrations.reasoning_gym.rewards.make_dataset``), and
each level makes its rows from a seed of its own (``LEVEL_SEED_STRIDE`` apart): a single task's level-k rows do not
depend on which other levels a run asks for.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable
from typing import Any

from grpo_lightning.config import ConfigError
from grpo_lightning.integrations.reasoning_gym.rewards import make_dataset

log = logging.getLogger(__name__)

PREFIX = "reasoning_gym:"
LIST_COMMAND = "python -m grpo_lightning.integrations.reasoning_gym.tasks"
LEVEL_SEED_STRIDE = 100_003  # each level's rows from a seed of its own
SEED_LIMIT = 2**32  # reasoning-gym's tasks seed numpy too, which takes seeds below 2**32


def level_count(task: str) -> int | None:
    """How many difficulty levels ``task``'s reasoning-gym curriculum has (its longest attribute); None: none."""
    from reasoning_gym.factory import create_curriculum, has_curriculum

    if not has_curriculum(task):
        return None
    return max((len(attr.levels) for attr in create_curriculum(task).attributes.values()), default=1)


def level_fields(task: str) -> set[str]:
    """The config keys ``task``'s curriculum sets at each level."""
    from reasoning_gym.factory import create_curriculum

    fields: set[str] = set()
    for attr in create_curriculum(task).attributes.values():
        fields.update(
            getattr(attr, name)
            for name in ("field_name", "lower_field_name", "upper_field_name")
            if hasattr(attr, name)
        )
    return fields


def refused_as_config_error(where: str, make: Callable[[], Any], fix: str = "") -> Any:
    """``make()``; reasoning-gym's refusal of its settings (an assertion, a bad value) as a one-line
    ``ConfigError`` naming ``where``, ``fix`` appended."""
    try:
        return make()
    except (AssertionError, ValueError, TypeError, KeyError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{where}: reasoning-gym refuses these settings: {reason}{fix}") from None


def task_levels(
    task: str, settings: dict[str, Any], curriculum: bool, levels: Any, where: str = "data.task_kwargs"
) -> list[int] | None:
    """The levels ``task``'s rows span: ``levels``, else every level under ``curriculum``; None: no levels (no
    ``level`` column). ``where``: the key that holds ``levels`` and the task's settings (a mixture's task: its
    ``datasets[i]``, whose settings are under ``config``)."""
    if levels is None and not curriculum:
        return None
    keys = where if where == "data.task_kwargs" else f"{where}.config"
    count = level_count(task)
    if count is None:
        if levels is not None:
            raise ConfigError(
                f"{where}.levels: {PREFIX}{task} has no reasoning-gym curriculum (no difficulty levels); remove levels"
            )
        log.warning(
            "data.curriculum: %s%s has no reasoning-gym curriculum (no difficulty levels); the pass-rate curriculum "
            "re-weights its prompts only",
            *(PREFIX, task),
        )
        return None
    if levels is not None:
        valid = isinstance(levels, list) and levels and len(set(levels)) == len(levels)
        if not valid or any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < count for v in levels):
            raise ConfigError(
                f"{where}.levels must be a list of distinct level numbers from 0 to {count - 1} "
                f"({PREFIX}{task} has {count}; got {levels!r})"
            )
    fixed = sorted(set(settings) & level_fields(task))
    if fixed:
        raise ConfigError(
            f"{keys}.{fixed[0]}: {PREFIX}{task}'s curriculum sets it at each difficulty level (levels, "
            "data.curriculum); remove it, or remove levels and unset data.curriculum"
        )
    return sorted(levels) if levels is not None else list(range(count))


class LeveledMixture:
    """A composite whose tasks make rows at levels of their curricula: row ``index``'s task is drawn as
    reasoning-gym's ``composite`` draws it (``Random(seed + index)``, in proportion to the weights), then one of
    that task's levels, each level equally likely, whose dataset (the curriculum's settings for it, from a seed of
    its own) makes the item. A task without levels makes its items at its own settings (level None)."""

    def __init__(self, specs: list[dict[str, Any]], size: int, seed: int) -> None:
        """
        Args:
            specs: the mixture's ``{name, weight, config, levels}``, levels resolved (a list, or None).
            size: items.
            seed: the mixture's seed; task ``i`` at level ``k`` makes its items from ``seed + i + 1 + k × stride``.
        """
        self.size, self.seed = size, seed
        self.names = [spec["name"] for spec in specs]
        self.weights = [float(spec.get("weight", 1.0)) for spec in specs]
        self.levels: list[list[int | None]] = [spec["levels"] or [None] for spec in specs]
        self.datasets: list[dict[int | None, Any]] = []
        for i, spec in enumerate(specs):
            made: dict[int | None, Any] = {}
            for level in self.levels[i]:
                where = f"data.task_kwargs.datasets[{i}] ({spec['name']})" + (
                    f" at level {level}" if level is not None else ""
                )
                settings = {**(spec.get("config") or {}), "size": size}
                settings["seed"] = (seed + i + 1 + (level or 0) * LEVEL_SEED_STRIDE) % SEED_LIMIT
                fix = "" if level is None else f"; choose other levels ({LIST_COMMAND} lists them)"
                made[level] = refused_as_config_error(
                    where, functools.partial(make_dataset, spec["name"], settings, level), fix
                )
            self.datasets.append(made)

    def __len__(self) -> int:
        return self.size

    def item(self, index: int) -> tuple[dict[str, Any], int | None]:
        """Item ``index`` and the level that made it."""
        rng = random.Random(self.seed + index)
        i = rng.choices(range(len(self.names)), weights=self.weights, k=1)[0]
        level = rng.choice(self.levels[i])
        try:
            return self.datasets[i][level][index], level
        except Exception as err:  # as for a single task: some curricula's top levels make no items
            at = f" at level {level}" if level is not None else ""
            reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
            raise ConfigError(
                f"data.task_kwargs.datasets[{i}] ({self.names[i]}){at}: reasoning-gym cannot make rows with these "
                f"settings ({reason}); choose other levels"
            ) from None
