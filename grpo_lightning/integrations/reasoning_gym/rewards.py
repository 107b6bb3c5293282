"""The ``reasoning_gym`` reward: reasoning-gym's own ``score_answer`` on the answer taken from each completion.

Rows of a ``reasoning_gym:<task>`` dataset (``grpo_lightning/integrations/reasoning_gym/tasks.py``) carry what the
scorer needs: ``task`` (the reasoning-gym task that made the row), ``answer`` (its reference answer, None where many
answers are right), ``metadata`` (the entry's metadata, as :func:`encode` writes it), ``task_config`` (the task's
settings, JSON) and, where difficulty levels are used, ``level``. The scorer is the task's own dataset rebuilt from
those settings (:func:`scoring_dataset`, cached), so a checker that reads its config (tolerances, word lists) scores as
the task generated. This module also holds what the task module shares with it: the encoding and the dataset's config.

reasoning-gym is an optional extra (``pip install -e ".[reasoning-gym]"``), imported only when a row is scored or a
task is built: importing this module (the reward registry does) costs nothing.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import Any

from grpo_lightning.config import ConfigError
from grpo_lightning.rewards import register
from grpo_lightning.rewards.combine import RewardError
from grpo_lightning.rewards.inputs import Completion, completion_texts, prompt_text
from grpo_lightning.rewards.math_extract import last_boxed

INSTALL_HINT = 'pip install -e ".[reasoning-gym]"'
EXTRACT_MODES = ("answer_tag", "last_line", "boxed")
_TAGS = ("__tuple__", "__set__", "__items__")  # how encode marks what JSON has no form for


def require(what: str) -> Any:
    """The ``reasoning_gym`` package; a one-line ``ConfigError`` saying how to install it when it is missing."""
    try:
        import reasoning_gym
    except ImportError as err:
        raise ConfigError(f"{what} needs the reasoning-gym package ({err}): {INSTALL_HINT}") from None
    return reasoning_gym


# ------------------------------------------------------------------------------------------------ the columns
def _plain(value: Any) -> Any:
    """``value`` with tuples, sets and dicts with non-string keys marked, numpy scalars as Python ones."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [_plain(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {"__set__": [_plain(v) for v in value]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not any(k in _TAGS for k in value):
            return {k: _plain(v) for k, v in value.items()}
        return {"__items__": [[_plain(k), _plain(v)] for k, v in value.items()]}
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):  # numpy scalars and arrays
        return _plain(value.tolist())
    raise TypeError(f"a {type(value).__name__} ({value!r:.60}) has no JSON form")


def _restore(value: Any) -> Any:
    if isinstance(value, list):
        return [_restore(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1 and "__tuple__" in value:
        return tuple(_restore(v) for v in value["__tuple__"])
    if len(value) == 1 and "__set__" in value:
        return {_restore(v) for v in value["__set__"]}
    if len(value) == 1 and "__items__" in value:
        return {_hashable(_restore(k)): _restore(v) for k, v in value["__items__"]}
    return {k: _restore(v) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return frozenset(key) if isinstance(key, set) else key


def encode(value: Any) -> str:
    """``value`` (an entry's metadata) as JSON text that :func:`decode` turns back into an equal value: tuples stay
    tuples, sets sets, integer keys integers (checkers compare them with ``==``). A type JSON cannot hold raises
    ``TypeError``."""
    return json.dumps(_plain(value), ensure_ascii=False)


def decode(text: str) -> Any:
    """The value :func:`encode` wrote."""
    return _restore(json.loads(text))


# ------------------------------------------------------------------------------------- the task's own dataset
def curriculum_context() -> Any:
    """How a curriculum level becomes settings: reasoning-gym's default, each range from the curriculum's easiest
    value up to that level's (``INCLUSIVE``). Its other mode, each range at that level's segment only
    (``UPPER_BOUND``), asks for settings that reasoning-gym 0.1.25 refuses or cannot make items of at level 1 and
    up in several tasks (countdown, letter_jumble, spell_backward, puzzle24, number_sequence)."""
    from reasoning_gym.coaching.base_curriculum import DefaultCurriculumContext, RangeAttributeMode

    return DefaultCurriculumContext(mode=RangeAttributeMode.INCLUSIVE)


def make_dataset(task: str, settings: dict[str, Any], level: int | None = None) -> Any:
    """reasoning-gym's dataset ``task`` made from ``settings`` (its config's keys, ``size`` and ``seed`` among
    them); at curriculum ``level`` the curriculum sets its attributes for that level and ``settings`` the rest.
    reasoning-gym's own errors (an unknown key, a refused value) are raised as they are."""
    require(f"reasoning_gym:{task}")
    from reasoning_gym.factory import DATASETS, create_curriculum

    dataset_cls, config_cls = DATASETS[task]
    if level is None:
        config = config_cls(**settings)
    else:
        curriculum = create_curriculum(task)
        curriculum.set_global_level(level)
        config = curriculum.generate_configuration(dict(settings), curriculum_context())
    if hasattr(config, "validate"):
        config.validate()
    return dataset_cls(config=config)


@functools.lru_cache(maxsize=64)
def scoring_dataset(task: str, task_config: str, level: int | None) -> Any:
    """The dataset whose ``score_answer`` scores rows of ``task`` made with ``task_config`` (JSON) at ``level``.
    ``size`` and ``seed`` pick which items a dataset makes, not how answers are checked: one item, seed 0, so that
    building it stays cheap."""
    return make_dataset(task, {**json.loads(task_config), "size": 1, "seed": 0}, level)


# ------------------------------------------------------------------------------------------------ the reward
def extract_answer(text: str, extract: str = "answer_tag") -> str | None:
    """The answer in a completion: the last ``<answer>…</answer>`` (stripped, as reasoning-gym's
    ``utils.extract_answer``), the last non-empty line, or the last ``\\boxed{}``; None when there is none."""
    if extract == "answer_tag":
        matches = re.findall(r"<answer>\s?(.*?)\s?</answer>", text, flags=re.DOTALL)
        return matches[-1].strip() if matches else None
    if extract == "last_line":
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return lines[-1] if lines else None
    return last_boxed(text)


def check_reasoning_gym_kwargs(extract: str = "answer_tag", **_: object) -> None:
    """Refuse, before training, an unknown ``extract`` mode or a missing reasoning-gym package (one line each)."""
    if extract not in EXTRACT_MODES:
        raise RewardError(f"reasoning_gym: unknown extract {extract!r}; use one of {', '.join(EXTRACT_MODES)}")
    try:
        require("the reasoning_gym reward")
    except ConfigError as err:
        raise RewardError(str(err)) from None


@register("reasoning_gym")
def reasoning_gym_reward(
    prompts: list[Any],
    completions: list[Completion],
    task: Sequence[str | None],
    metadata: Sequence[str | None],
    answer: Sequence[str | None],
    task_config: Sequence[str | None],
    level: Sequence[int | None] | None = None,
    *,
    extract: str = "answer_tag",
    **kwargs: Any,
) -> list[float | None]:
    """reasoning-gym's ``score_answer`` (in [0, 1]: 1.0 right, partial credit where the task gives it) of the
    answer ``extract`` takes from each completion (``answer_tag``, ``last_line`` or ``boxed``); 0.0 when there is
    no answer to take, or when the checker fails on it; None for a row no reasoning-gym task made."""
    texts = completion_texts(completions)  # a conversation's completions are message lists
    levels = level if level is not None else [None] * len(texts)
    scores: list[float | None] = []
    failures = 0
    for prompt, text, name, meta, ref, config, lvl in zip(
        prompts, texts, task, metadata, answer, task_config, levels, strict=True
    ):
        if name is None or meta is None or config is None:
            scores.append(None)
            continue
        found = extract_answer(text, extract)
        if found is None:
            scores.append(0.0)
            continue
        entry = {"question": prompt_text(prompt), "answer": ref, "metadata": decode(meta)}
        dataset = scoring_dataset(name, config, None if lvl is None else int(lvl))
        try:
            scores.append(float(dataset.score_answer(found, entry)))
        except Exception:  # a checker that chokes on a malformed answer: that answer is wrong
            failures += 1
            scores.append(0.0)
    log_metric = kwargs.get("log_metric")
    if log_metric is not None:
        _log_per_task(log_metric, task, scores)
        if failures:
            log_metric("reasoning_gym/checker_failures", float(failures))
    return scores


def _log_per_task(log_metric: Any, tasks: Sequence[str | None], scores: list[float | None]) -> None:
    # A mixture's tasks learn at different speeds: each one's mean score, next to the reward's overall mean.
    by_task: dict[str, list[float]] = {}
    for name, value in zip(tasks, scores):
        if name is not None and value is not None:
            by_task.setdefault(name, []).append(value)
    for name, values in by_task.items():
        log_metric(f"reasoning_gym/{name}", sum(values) / len(values))


reasoning_gym_reward.required_columns = ("task", "metadata", "answer", "task_config")
reasoning_gym_reward.check_kwargs = check_reasoning_gym_kwargs  # RewardSpec.build: a bad mode stops the run early
