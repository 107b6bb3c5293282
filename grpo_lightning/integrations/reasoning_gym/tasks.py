"""``data.dataset: reasoning_gym:<task>``: a reasoning-gym task, or a weighted mixture of several, as a
``DatasetDict`` with ``train`` and ``test`` splits (reasoning-gym is an optional extra, imported only here).

``data.task_kwargs`` holds the task's own settings (the keys of its reasoning-gym config, e.g. ``min_terms`` of
``basic_arithmetic``), ``size`` (training rows, 500) and ``seed`` (0), and three of ours: ``test_size`` (held-out
rows, 100), ``template`` (the prompt, ``{question}``) and ``levels`` (below). ``reasoning_gym:composite`` mixes
tasks through reasoning-gym's ``composite``: ``datasets: [{name, weight, config}]``, each row drawn from a task in
proportion to its weight.

Columns: ``prompt`` (the question, through ``template``), ``answer`` (the reference; None where many answers are
right), ``task`` (the task that made the row), ``metadata`` and ``task_config`` (what the ``reasoning_gym`` reward,
``grpo_lightning/integrations/reasoning_gym/rewards.py``, rebuilds the task's checker from), and ``level`` under levels.

Held-out rows are made by the same settings with another seed (``seed + 2**31``); a question that is also a
training question (or an earlier held-out one) is skipped, so that no held-out prompt is ever trained on.

Levels: a task with a reasoning-gym curriculum makes its rows at the ``levels`` given (a list of level numbers), or,
when the run has ``data.curriculum`` (``curriculum=True``) and ``levels`` is unset, at every level it has: in equal
shares, a ``level`` column, each level from a seed of its own and with the curriculum's settings for it (each range
from the easiest value up to that level's, as reasoning-gym's own curricula make them). The pass-rate curriculum
then draws from all of them, moving off the prompts it finds always (or never) solved. Some curricula's top levels
ask reasoning-gym 0.1.25 for settings it refuses (a one-line error naming the level) or makes slowly: ``levels``
picks the others. ``python -m grpo_lightning.integrations.reasoning_gym.tasks`` lists the tasks and their levels.

In a mixture each task takes its own ``levels`` (``datasets: [{name, weight, config, levels}]``), or all of its
levels under ``data.curriculum``: a row's task is drawn by weight as reasoning-gym's composite draws it, then one of
that task's levels (:class:`LeveledMixture`); a task without a curriculum keeps its own settings (level None).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import logging
from typing import TYPE_CHECKING, Any

from grpo_lightning.config import ConfigError
from grpo_lightning.integrations.reasoning_gym.levels import (
    LEVEL_SEED_STRIDE,
    LIST_COMMAND,
    PREFIX,
    SEED_LIMIT,
    LeveledMixture,
    level_count,
    refused_as_config_error,
    task_levels,
)
from grpo_lightning.integrations.reasoning_gym.rewards import encode, make_dataset, require

if TYPE_CHECKING:  # datasets is imported when a task is built
    from datasets import DatasetDict

log = logging.getLogger(__name__)

TEST_SEED_OFFSET = 2**31  # held-out rows: seeds far from the training ones, whose items are Random(seed + index)
_OURS = ("size", "seed", "test_size", "template", "levels")


def task_names() -> list[str]:
    """The names reasoning-gym registers (``composite`` among them)."""
    require(f"data.dataset: {PREFIX}<task>")
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def load(
    task: str,
    *,
    curriculum: bool = False,
    size: int = 500,
    seed: int = 0,
    test_size: int = 100,
    template: str = "{question}",
    levels: list[int] | None = None,
    **settings: Any,
) -> DatasetDict:
    """``reasoning_gym:<task>``'s ``train`` (``size`` rows) and ``test`` (``test_size`` rows, none of them a
    training question) splits; ``settings`` are the task's own config keys (``datasets`` for ``composite``);
    ``levels``: rows at these levels of the task's curriculum (a ``level`` column); ``curriculum``: at all of them
    when ``levels`` is unset. Bad settings are refused in one line (``ConfigError``) naming the ``data.task_kwargs``
    key."""
    for name, value, low in (("size", size, 1), ("seed", seed, 0), ("test_size", test_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"data.task_kwargs.{name} must be an integer >= {low} (got {value!r})")
    try:
        if "{question}" not in template:
            raise KeyError("question")
        template.format(question="")
    except (KeyError, IndexError, ValueError, AttributeError) as err:
        raise ConfigError(
            f"data.task_kwargs.template must hold {{question}} and no other {{field}} (got {template!r}: {err!r})"
        ) from None
    names = task_names()
    if task not in names:
        close = difflib.get_close_matches(task, names, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"data.dataset: {PREFIX}{task} is not a reasoning-gym task{hint}; list them: {LIST_COMMAND}")
    try:
        key = json.dumps(settings, sort_keys=True)
    except TypeError as err:
        raise ConfigError(f"data.task_kwargs of {PREFIX}{task}: settings must be plain YAML values ({err})") from None
    if task == "composite":
        if levels is not None:
            raise ConfigError(
                f"data.task_kwargs.levels: {PREFIX}composite takes levels per task (datasets[i].levels); move it there"
            )
        key = json.dumps(_mixture_levels(settings, curriculum), sort_keys=True)
        return _build(task, key, None, size, seed, test_size, template)
    chosen = task_levels(task, settings, curriculum, levels)
    return _build(task, key, tuple(chosen) if chosen is not None else None, size, seed, test_size, template)


@functools.lru_cache(maxsize=4)  # the training and held-out rows are asked for apart: one build serves both
def _build(
    task: str, key: str, levels: tuple[int, ...] | None, size: int, seed: int, test_size: int, template: str
) -> DatasetDict:
    from datasets import Dataset, DatasetDict

    settings = json.loads(key)
    configs = _check_settings(task, settings)  # each task that makes rows: its settings (for its checker)
    parts: list[int | None] = list(levels) if levels is not None else [None]
    leveled = levels is not None or _is_leveled_mixture(task, settings)

    def rows(entries: Any, count: int, level: int | None, seen: set[str] | None = None) -> list[dict[str, Any]]:
        """``count`` rows of ``entries``; with ``seen``, only questions not in it (which it then takes in)."""
        made = []
        for index in range(len(entries)):
            if len(made) == count:
                break
            entry, at = _item(task, entries, index, level)
            prompt = template.format(question=entry["question"])
            if seen is not None:
                if prompt in seen:  # a training question (or an earlier held-out one): not held out
                    continue
                seen.add(prompt)
            made.append(_row(task, entry, prompt, configs, at, leveled))
        return made

    train: list[dict[str, Any]] = []
    for k, level in enumerate(parts):
        if count := _share(size, len(parts), k):
            train += rows(_entries(task, settings, count, seed + (level or 0) * LEVEL_SEED_STRIDE, level), count, level)
    seen = {row["prompt"] for row in train}
    test: list[dict[str, Any]] = []
    for k, level in enumerate(parts):
        if count := _share(test_size, len(parts), k):
            # A few times more candidates than needed: tasks with few distinct questions repeat training ones.
            test_seed = seed + TEST_SEED_OFFSET + (level or 0) * LEVEL_SEED_STRIDE
            test += rows(_entries(task, settings, 2 * count + 16, test_seed, level), count, level, seen)
    if not test:
        raise ConfigError(
            f"data.task_kwargs: every held-out question of {PREFIX}{task} is a training question (the task has few "
            "distinct questions); lower size, or make the task harder"
        )
    if len(test) < test_size:
        log.warning(
            "%s%s: %d held-out rows, not test_size %d: the task has few questions that training does not have",
            *(PREFIX, task, len(test), test_size),
        )
    return DatasetDict({"train": Dataset.from_list(train), "test": Dataset.from_list(test)})


def _share(total: int, parts: int, k: int) -> int:
    return total // parts + (k < total % parts)


def _item(task: str, entries: Any, index: int, level: int | None) -> tuple[dict[str, Any], int | None]:
    """Item ``index`` of ``entries`` and its level (a leveled mixture's own, else ``level``)."""
    try:
        if isinstance(entries, LeveledMixture):
            return entries.item(index)
        return entries[index], level
    except ConfigError:
        raise
    except Exception as err:  # reasoning-gym could not make an item with these settings (some curricula's top levels)
        at = f" at level {level}" if level is not None else ""
        fix = "choose other data.task_kwargs.levels" if level is not None else "change data.task_kwargs"
        reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        raise ConfigError(
            f"data.task_kwargs of {PREFIX}{task}{at}: reasoning-gym cannot make rows with these settings ({reason}); "
            f"{fix}"
        ) from None


def _row(
    task: str, entry: dict[str, Any], prompt: str, configs: dict[str, str], level: int | None, leveled: bool
) -> dict[str, Any]:
    made_by = entry["metadata"].get("source_dataset", task)
    try:
        metadata = encode(entry["metadata"])
    except TypeError as err:
        raise ConfigError(f"data.dataset: {PREFIX}{made_by}'s rows cannot be stored as columns ({err})") from None
    row = {"prompt": prompt, "answer": entry["answer"], "task": made_by, "metadata": metadata}
    row["task_config"] = configs[made_by]
    if leveled:  # every row has the key (None: a mixture's task without levels), so the column is kept
        row["level"] = level
    return row


def _entries(task: str, settings: dict[str, Any], size: int, seed: int, level: int | None) -> Any:
    """The reasoning-gym dataset (items made on demand) of ``size`` items from ``seed``; a refused setting is a
    one-line ``ConfigError``."""
    seed %= SEED_LIMIT
    if task != "composite":
        where = f"data.task_kwargs of {PREFIX}{task}" + (f" at level {level}" if level is not None else "")
        fix = "" if level is None else f"; choose other data.task_kwargs.levels ({LIST_COMMAND} lists them)"
        return refused_as_config_error(
            where, lambda: make_dataset(task, {**settings, "size": size, "seed": seed}, level), fix
        )

    if _is_leveled_mixture(task, settings):
        return LeveledMixture(settings["datasets"], size, seed)

    def composite() -> Any:
        from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

        specs = [
            DatasetSpec(d["name"], float(d.get("weight", 1.0)), dict(d.get("config") or {}))
            for d in settings["datasets"]
        ]
        config = CompositeConfig(size=size, seed=seed, datasets=specs)
        config.validate()
        return CompositeDataset(config)

    return refused_as_config_error("data.task_kwargs.datasets", composite)


def _check_settings(task: str, settings: dict[str, Any]) -> dict[str, str]:
    """Refuse a key the task does not take (naming the ``data.task_kwargs`` key); the task names that make rows, each
    with its settings as the ``task_config`` column holds them."""
    if task != "composite":
        _known_keys(task, settings, "data.task_kwargs", ours=True)  # size and seed are load's own arguments
        return {task: json.dumps(settings, sort_keys=True)}
    from reasoning_gym.factory import DATASETS

    extra = sorted(set(settings) - {"datasets"})
    specs = settings.get("datasets")
    if extra or not isinstance(specs, list) or not specs:
        raise ConfigError(
            f"data.task_kwargs of {PREFIX}composite takes datasets: [{{name, weight, config, levels}}, ...], size, "
            f"seed, test_size and template (got {', '.join(extra) or 'no datasets list'})"
        )
    configs: dict[str, str] = {}
    for i, spec in enumerate(specs):
        where = f"data.task_kwargs.datasets[{i}]"
        if not isinstance(spec, dict) or set(spec) - {"name", "weight", "config", "levels"} or "name" not in spec:
            raise ConfigError(f"{where} must be {{name, weight, config, levels}} (got {spec!r})")
        name, weight, config = spec["name"], spec.get("weight", 1.0), spec.get("config") or {}
        if name not in DATASETS or name == "composite":
            raise ConfigError(f"{where}.name: {name!r} is not a reasoning-gym task; list them: {LIST_COMMAND}")
        if name in configs:
            raise ConfigError(f"{where}.name: {name} is in the mixture twice; give it one entry (and its weight)")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ConfigError(f"{where}.weight must be a number > 0 (got {weight!r})")
        if not isinstance(config, dict):
            raise ConfigError(f"{where}.config must be a mapping of {name}'s settings (got {config!r})")
        _known_keys(name, config, f"{where}.config", ours=False)
        configs[name] = json.dumps(config, sort_keys=True)
    return configs


def _known_keys(task: str, settings: dict[str, Any], where: str, *, ours: bool) -> None:
    from reasoning_gym.factory import DATASETS

    known = {f.name for f in dataclasses.fields(DATASETS[task][1])}
    for key in settings:
        if key not in known:
            listed = ", ".join(sorted(known - set(_OURS)))
            also = f"; and ours: {', '.join(_OURS)}" if ours else ""
            raise ConfigError(f"{where}: {task} has no setting {key!r}; its settings: {listed}{also}")


def _mixture_levels(settings: dict[str, Any], curriculum: bool) -> dict[str, Any]:
    """A composite's settings with each task's levels resolved (``datasets[i].levels``: a list, or None)."""
    _check_settings("composite", settings)  # the specs' shape first: their levels are read below
    specs = []
    for i, spec in enumerate(settings["datasets"]):
        config = spec.get("config") or {}
        chosen = task_levels(spec["name"], config, curriculum, spec.get("levels"), f"data.task_kwargs.datasets[{i}]")
        specs.append({**spec, "levels": chosen})
    return {**settings, "datasets": specs}


def _is_leveled_mixture(task: str, settings: dict[str, Any]) -> bool:
    return task == "composite" and any(spec.get("levels") for spec in settings["datasets"])


def _main() -> None:
    """Print the task names, with the number of difficulty levels of those that have a curriculum."""
    for name in task_names():
        count = None if name == "composite" else level_count(name)
        print(f"{PREFIX}{name}" + (f"  ({count} levels)" if count else ""))


if __name__ == "__main__":
    _main()
