"""What a reward function is called with, the way TRL's ``GRPOTrainer`` (1.16) calls it, and which settings it takes.

Every call passes, by keyword: ``prompts``, ``completions``, the dataset's other columns (one value per completion),
``completion_ids`` (the completion's token ids, without padding, when the rollout gives them), ``trainer_state``
(``global_step`` and ``epoch``), ``log_extra(column, values)`` and ``log_metric(name, value)``. A function that
takes ``**kwargs`` gets all of them; one that does not gets only those it names, so a fixed signature such as
``fn(prompts, completions, answer)`` keeps working. A completion is its text, or, when its prompt is a conversation
(a list of ``{role, content}`` messages), a one-message list ``[{"role": "assistant", "content": text}]``, as TRL
passes it; :func:`completion_text` turns either form back into text.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from grpo_lightning.config import ConfigError

# Keyword arguments the rollout passes to every call: a reward's ``kwargs`` cannot set them (the call's would win).
PASSED_BY_ROLLOUT = (
    *("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric"),
    # columns the rollout adds (policy tokens; multi-turn transcripts and each trajectory's environment)
    *("completion_lengths", "transcripts", "environments"),
)

Completion = str | list[dict[str, Any]]


def is_conversation(prompt: Any) -> bool:
    """Whether ``prompt`` is a conversation: a non-empty list of ``{role, content}`` messages (TRL's test)."""
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
    )


def as_completions(prompts: Sequence[Any], texts: Sequence[str]) -> list[Completion]:
    """The completions as TRL passes them: the text, or ``[{"role": "assistant", "content": text}]`` where the
    prompt is a conversation."""
    return [
        [{"role": "assistant", "content": text}] if is_conversation(prompt) else text
        for prompt, text in zip(prompts, texts, strict=True)
    ]


def completion_text(completion: Completion) -> str:
    """The text of a completion given as text or as a list of messages (its last message's content)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content", "")
        if isinstance(content, list):  # typed content blocks: [{"type": "text", "text": ...}, ...]
            # An image block shows as <image>; a dataset column of blocks gives every block a "text", None where
            # it had none.
            return "".join(
                "<image>" if block.get("type") == "image" else str(block.get("text") or "")
                for block in content
                if isinstance(block, dict)
            )
        return str(content)
    return str(completion)


def completion_texts(completions: Sequence[Completion]) -> list[str]:
    """:func:`completion_text` of each completion: what a reward that reads text starts with."""
    return [completion_text(c) for c in completions]


def prompt_text(prompt: str | list[dict[str, Any]]) -> str:
    """A prompt as plain text: a conversation becomes one ``role: content`` line per message."""
    if is_conversation(prompt):
        return "\n".join(f"{m['role']}: {completion_text([m])}" for m in prompt)
    return str(prompt)


class TrainerStateUnknown(RuntimeError):
    """A reward read ``trainer_state`` where no training step is known."""


class TrainerState:
    """``trainer_state`` for reward functions: TRL passes its ``TrainerState``; this gives ``global_step`` (optimizer
    steps done) and ``epoch``, set by whoever drives the rollout (:meth:`update`).

    Reading them before anyone set them raises (``TrainerStateUnknown``, not an ``AttributeError`` that
    ``getattr(state, "global_step", 0)`` would swallow) instead of answering 0: a reward that shapes itself by the
    step would otherwise silently stay at step 0.
    """

    def __init__(self) -> None:
        self._step: int | None = None
        self._epoch: float | None = None

    def update(self, global_step: int, epoch: float) -> None:
        """Record the training progress that the next scored completions were sampled at."""
        self._step, self._epoch = int(global_step), float(epoch)

    @property
    def known(self) -> bool:
        return self._step is not None

    @property
    def global_step(self) -> int:
        if self._step is None:
            raise TrainerStateUnknown(_UNKNOWN.format("global_step"))
        return self._step

    @property
    def epoch(self) -> float:
        if self._epoch is None:
            raise TrainerStateUnknown(_UNKNOWN.format("epoch"))
        return self._epoch

    def __repr__(self) -> str:
        return f"TrainerState(global_step={self._step}, epoch={self._epoch})"


_UNKNOWN = (
    "trainer_state.{} is not known here: nothing told this scorer the training step (Scorer.trainer_state.update)"
)


class RewardLog:
    """What reward functions log during one scoring call, through TRL's ``log_metric`` and ``log_extra``."""

    def __init__(self) -> None:
        self.metrics: dict[str, list[float]] = {}
        self.columns: dict[str, list[Any]] = {}

    def log_metric(self, name: str, value: float) -> None:
        """A scalar for this batch (averaged over the calls of one scoring)."""
        self.metrics.setdefault(name, []).append(float(value))

    def log_extra(self, column: str, values: list[Any]) -> None:
        """An extra column for the completions, one value each."""
        self.columns.setdefault(column, []).extend(values)

    def metric_means(self) -> dict[str, float]:
        return {name: sum(values) / len(values) for name, values in self.metrics.items() if values}


def _parameters(fn: Callable[..., Any]) -> dict[str, inspect.Parameter] | None:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin or C callable without an inspectable signature
        return None


def _takes_any(parameters: dict[str, inspect.Parameter]) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_POSITIONAL = (
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
    inspect.Parameter.VAR_POSITIONAL,
)


def call_arguments(
    fn: Callable[..., Any], prompts: list[Any], completions: list[Any], data: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for calling ``fn``: everything by keyword (as TRL calls it), filtered to the names ``fn``
    takes unless it takes ``**kwargs``. A function whose first two parameters are named after nothing passed
    (``def fn(p, c, answer)``) gets prompts and completions positionally, as before TRL's convention."""
    parameters = _parameters(fn)
    if parameters is None:
        return (prompts, completions), dict(data)
    named = {name for name, p in parameters.items() if p.kind in _NAMED}
    positional = [p for p in parameters.values() if p.kind in _POSITIONAL]
    passed = {"prompts", "completions", *data}
    if not positional or any(p.name in passed for p in positional[:2]):
        args: tuple[Any, ...] = ()
        kwargs = {"prompts": prompts, "completions": completions, **data}
    else:
        args, kwargs = (prompts, completions), dict(data)
    if not _takes_any(parameters):
        kwargs = {key: value for key, value in kwargs.items() if key in named}
    return args, kwargs


def reward_settings(fn: Callable[..., Any]) -> tuple[str, ...] | None:
    """The ``kwargs`` keys ``fn`` takes as settings; None when it takes any key.

    Settings are the keyword-only parameters (those after ``*``) of a function that also takes ``**kwargs``: its
    ``**kwargs`` then collects the data (columns, ``completion_ids``, ...), as the built-in rewards do. A function
    without ``**kwargs`` takes its named parameters; one with ``**kwargs`` and no keyword-only parameter takes any
    key (it may read them from ``kwargs``). A ``settings`` attribute (a tuple of names) overrides all this: the
    built-in ``exact_answer``, which has no settings but ``**_`` for the columns, declares ``settings = ()``.
    Names the rollout passes itself are never settings.
    """
    base = fn.func if isinstance(fn, functools.partial) else fn
    declared = getattr(base, "settings", None)
    if declared is not None:
        return tuple(declared)
    parameters = _parameters(base)
    if parameters is None:
        return None
    keyword_only = [name for name, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    if _takes_any(parameters):
        if not keyword_only:
            return None
        names = keyword_only
    else:
        names = [name for name, p in parameters.items() if p.kind in _NAMED]
    return tuple(name for name in names if name not in PASSED_BY_ROLLOUT)


def check_reward_kwargs(name: str, fn: Callable[..., Any], kwargs: dict[str, Any], where: str) -> None:
    """Refuse, in one line naming ``where`` and the reward, a ``kwargs`` key that ``fn`` does not take as a setting
    (:func:`reward_settings`) or that the rollout passes itself."""
    valid = reward_settings(fn)
    for key in kwargs:
        if key in PASSED_BY_ROLLOUT:
            raise ConfigError(f"{where} ({name}): kwargs key {key!r} is passed by the rollout itself; remove it")
        if valid is not None and key not in valid:
            listed = ", ".join(valid) or "none (it takes no settings)"
            raise ConfigError(f"{where} ({name}): unknown kwargs key {key!r}; valid: {listed}")


def is_async_reward(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is an ``async def`` function (or a partial of one, or an object with an ``async __call__``)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.iscoroutinefunction(fn):
        return True
    # An object whose class defines ``async def __call__`` (TRL's test too).
    return not inspect.isroutine(fn) and inspect.iscoroutinefunction(inspect.getattr_static(type(fn), "__call__", None))


@dataclass
class RewardCall:
    """One scoring call's inputs, as every reward function of the call gets them."""

    prompts: list[Any]
    completions: list[Completion]  # as passed: the text, or a one-message list where the prompt is a conversation
    texts: list[str]  # the completions' texts, for checks and error messages
    columns: dict[str, list[Any]]  # one value per completion: the dataset's columns, completion_ids, ...
    context: dict[str, Any] = field(default_factory=dict)  # one per call: trainer_state, log_extra, log_metric

    @classmethod
    def of(
        cls,
        prompts: Sequence[Any],
        texts: Sequence[str],
        columns: dict[str, list[Any]],
        context: dict[str, Any] | None = None,
    ) -> RewardCall:
        """The call for completions ``texts`` of ``prompts`` (one prompt per completion)."""
        return cls(list(prompts), as_completions(prompts, texts), list(texts), dict(columns), dict(context or {}))

    def __len__(self) -> int:
        return len(self.texts)

    def row(self, i: int) -> RewardCall:
        """The call for completion ``i`` alone."""
        columns = {name: values[i : i + 1] for name, values in self.columns.items()}
        one = slice(i, i + 1)
        return RewardCall(self.prompts[one], self.completions[one], self.texts[one], columns, self.context)

    def invoke(self, fn: Callable[..., Any]) -> Any:
        """``fn`` called with this call's inputs (:func:`call_arguments`); a coroutine for an async ``fn``."""
        args, kwargs = call_arguments(fn, self.prompts, self.completions, {**self.columns, **self.context})
        return fn(*args, **kwargs)
