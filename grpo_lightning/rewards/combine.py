"""Score completions with several reward functions and combine them into one reward per completion.

The time limits (:func:`time_limit`, :func:`call_with_time_limit`) live in ``time_limits.py`` and are imported
from here too, as they always were.
"""

from __future__ import annotations

import functools
import math
import numbers
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from grpo_lightning.errors import UserFacingError
from grpo_lightning.rewards.async_rewards import AsyncOutcome, run_one, start
from grpo_lightning.rewards.inputs import RewardCall, check_reward_kwargs, is_async_reward
from grpo_lightning.rewards.time_limits import TimeLimitExceeded, call_with_time_limit
from grpo_lightning.rewards.time_limits import alarm_available as alarm_available  # re-exported
from grpo_lightning.rewards.time_limits import time_limit as time_limit  # re-exported


class RewardError(UserFacingError, RuntimeError):
    """A reward function is misconfigured or returned something unusable. The message names the function (exit
    status 2, ``errors.py``)."""


@dataclass
class RewardSpec:
    """One term of the reward: a registered name (or import path), its weight and keyword arguments."""

    name: str
    """A registered reward's name (``grpo_lightning.rewards.available()``) or a function's import path
    ``package.module.function``; it is also the reward's column in the logs (``reward/<name>``)."""
    weight: float = 1.0
    """Its factor in the completion's total reward, the weighted sum of the terms (any number: negative penalises)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments bound to the function, checked against its parameters before training."""

    def build(self, where: str = "data.rewards") -> Callable[..., list]:
        """The function with its ``kwargs`` bound; a key it does not take (``inputs.reward_settings``) is refused
        in one line naming ``where`` (the config key of this term), before training starts."""
        from grpo_lightning.rewards import get

        fn = get(self.name)
        check_reward_kwargs(self.name, fn, self.kwargs, where)
        check = getattr(fn, "check_kwargs", None)
        if check is not None:
            check(**self.kwargs)  # the function refuses settings that cannot work now, before training starts
        return functools.partial(fn, **self.kwargs) if self.kwargs else fn


def _find_slow_completion(probe: Callable[[int], Any], seconds: float, count: int) -> int | None:
    """Index of the first of ``count`` completions whose call alone (``probe(i)`` raises
    :class:`TimeLimitExceeded`) takes longer than ``seconds``, within a budget of 2 × seconds."""
    deadline = time.monotonic() + 2 * seconds
    for i in range(count):
        if time.monotonic() > deadline:
            return None
        try:
            probe(i)
        except TimeLimitExceeded:
            return i
        except Exception:
            continue
    return None


def required_columns(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The dataset columns a reward function declares it needs (``fn.required_columns``)."""
    base = fn.func if isinstance(fn, functools.partial) else fn
    return tuple(getattr(base, "required_columns", ()))


def check_required_columns(specs: Sequence[RewardSpec], columns: Sequence[str], where: str) -> None:
    """Raise a one-line error when a reward function needs a column that ``where`` does not have."""
    for spec in specs:
        for column in required_columns(spec.build()):
            if column not in columns:
                raise RewardError(
                    f"reward {spec.name!r} needs the column {column!r}, which {where} does not have "
                    f"(columns: {', '.join(columns)})"
                )


def _check_values(name: str, values: Any, completions: Sequence[str]) -> list[float | None]:
    if not isinstance(values, (list, tuple)) or len(values) != len(completions):
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
        raise RewardError(
            f"reward {name!r} returned {got} for {len(completions)} completions; return one per completion"
        )
    checked: list[float | None] = []
    for i, value in enumerate(values):
        if value is None:
            checked.append(None)
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise RewardError(
                f"reward {name!r} returned {value!r} for completion {i} ({completions[i][:80]!r}); "
                "return a finite number or None"
            )
        checked.append(float(value))
    return checked


@dataclass
class RewardTerm:
    """One reward function of a scoring call, with how its values are checked and what 0 means for it."""

    spec: RewardSpec
    fn: Callable[..., Any]
    check: Callable[[str, Any, Sequence[str]], list]
    zeros: Callable[[], list]


def _settle(
    term: RewardTerm,
    call: RewardCall,
    run: Callable[[], Any],
    probe: Callable[[int], Any],
    on_error: Literal["raise", "zero"],
    timeout_s: float | None,
) -> list:
    """``run()``'s values checked by ``term.check``; the same failure handling for every kind of function.

    A function that raises, returns something unusable (``RewardError``) or runs past ``timeout_s`` (its call on
    the whole batch) is reported with its name, and with the first completion that alone (``probe(i)``) also runs
    past the limit (looked for within 2 × ``timeout_s``); with ``on_error="zero"`` it gives ``term.zeros()``.
    """
    name = term.spec.name
    try:
        return term.check(name, run(), call.texts)
    except TimeLimitExceeded as err:
        if err.token is not None:
            raise  # an enclosing time limit of the caller's ran out, not ours
        if on_error == "zero":
            return term.zeros()
        assert timeout_s is not None
        slow = _find_slow_completion(probe, timeout_s, len(call))
        where = (
            f"completion {slow} alone ({call.texts[slow][:80]!r}) takes longer"
            if slow is not None
            else "no single completion was found to take that long alone"
        )
        raise RewardError(
            f"reward {name!r} ran longer than timeout_s={timeout_s:g}s on a batch of {len(call)} completions; {where}"
        ) from None
    except RewardError:
        if on_error == "zero":
            return term.zeros()
        raise
    except Exception as err:  # a user's function failed: name it and the data it failed on
        if on_error == "zero":
            return term.zeros()
        raise RewardError(
            f"reward {name!r} raised {type(err).__name__}: {err} "
            f"(first completion of the batch: {call.texts[0][:80]!r})"
        ) from err


def call_reward(
    term: RewardTerm, call: RewardCall, *, on_error: Literal["raise", "zero"] = "raise", timeout_s: float | None = None
) -> list:
    """A synchronous function's checked values for the batch of ``call``, limited by :func:`call_with_time_limit`."""
    return _settle(
        term,
        call,
        lambda: call_with_time_limit(call.invoke, timeout_s, term.fn),
        lambda i: call_with_time_limit(call.row(i).invoke, timeout_s, term.fn),
        on_error,
        timeout_s,
    )


def _async_values(term: RewardTerm, outcome: AsyncOutcome, timeout_s: float | None) -> Any:
    if outcome.blocked:
        raise RewardError(
            f"reward {term.spec.name!r} (async def) ran past timeout_s={timeout_s:g}s and blocked the event loop: "
            "an async reward must await (asyncio.sleep, an async client), not block; use a plain def for blocking code"
        )
    if outcome.timed_out:
        raise TimeLimitExceeded(timeout_s or 0.0)
    if outcome.error is not None:
        raise outcome.error
    return outcome.value


def _async_probe(term: RewardTerm, call: RewardCall, timeout_s: float | None) -> Callable[[int], Any]:
    def probe(i: int) -> Any:
        outcome = run_one(lambda: call.row(i).invoke(term.fn), timeout_s)
        if outcome.blocked or outcome.timed_out:
            raise TimeLimitExceeded(timeout_s or 0.0)
        return outcome.value

    return probe


def run_terms(
    terms: Sequence[RewardTerm],
    call: RewardCall,
    *,
    on_error: Literal["raise", "zero"] = "raise",
    timeout_s: float | None = None,
) -> list[list]:
    """Every term's checked values, in order. ``async def`` functions run together on the event loop
    (``rewards/async_rewards.py``, each limited to ``timeout_s``) while the others run here one after another."""
    asynchronous = [i for i, term in enumerate(terms) if is_async_reward(term.fn)]
    pending = (
        start([lambda term=terms[i]: call.invoke(term.fn) for i in asynchronous], timeout_s) if asynchronous else None
    )
    values: list[list | None] = [None] * len(terms)
    try:
        for i, term in enumerate(terms):
            if i not in asynchronous:
                values[i] = call_reward(term, call, on_error=on_error, timeout_s=timeout_s)
    except BaseException:
        if pending is not None:
            pending.cancel()
        raise
    if pending is not None:
        for i, outcome in zip(asynchronous, pending.wait(), strict=True):
            term = terms[i]
            values[i] = _settle(
                term,
                call,
                lambda term=term, outcome=outcome: _async_values(term, outcome, timeout_s),
                _async_probe(term, call, timeout_s),
                on_error,
                timeout_s,
            )
    return values  # type: ignore[return-value]


def score(
    specs: Sequence[RewardSpec],
    fns: Sequence[Callable[..., list]],
    prompts: list[Any],
    completions: list[str],
    columns: dict[str, list[Any]],
    *,
    on_error: Literal["raise", "zero"] = "raise",
    timeout_s: float | None = None,
    context: dict[str, Any] | None = None,
) -> tuple[list[float], dict[str, list[float | None]]]:
    """Run every (outcome) reward function; return the weighted total per completion and each function's values.

    ``completions`` are texts; a function gets each as TRL passes it (``rewards/inputs.py``), with ``columns`` and
    ``context`` (per call: ``trainer_state``, ``log_extra``, ``log_metric``). ``None`` (not applicable) is left out
    of the total (as TRL's ``nansum``: a completion no function applies to totals 0) and out of that function's
    logged mean. Failures are handled by :func:`call_reward`.
    """
    call = RewardCall.of(prompts, completions, columns, context)
    zeros = [0.0] * len(completions)
    terms = [RewardTerm(spec, fn, _check_values, lambda: list(zeros)) for spec, fn in zip(specs, fns, strict=True)]
    values = run_terms(terms, call, on_error=on_error, timeout_s=timeout_s)
    per_function = {spec.name: column for spec, column in zip(specs, values, strict=True)}
    total, _ = combine_columns(per_function, {spec.name: spec.weight for spec in specs}, len(completions))
    return total, per_function


def column_weight(weights: Mapping[str, float], name: str) -> float:
    """The weight of the reward column ``name``: its source's (``data.rewards[].weight``, an environment's
    ``reward_weights()``); 1 for a column no source weighs (an agent's parts, a TRL class's ``get_reward``)."""
    return float(weights.get(name, 1.0))


def combine_columns(
    columns: Mapping[str, Sequence[float | None]], weights: Mapping[str, float], rows: int
) -> tuple[list[float], list[bool]]:
    """The one rule of every source of reward (reward functions, an environment's parts, an agent's return): each is
    a column of one value per row, ``None`` where it does not apply (TRL's NaN), weighed by ``column_weight``.

    Returns each row's total, the weighted sum of its values with None left out (TRL's ``nansum``), and whether it
    is unscorable: no column gives it a value (also when there is no column at all). TRL marks a row the same way
    (``isnan(rewards_per_func).all(dim=1)``, its environments' ``get_reward`` one more column).
    """
    total, unscorable = [0.0] * rows, [True] * rows
    for name, values in columns.items():
        if len(values) != rows:
            raise ValueError(f"reward column {name!r} has {len(values)} values for {rows} rows")
        weight = column_weight(weights, name)
        for i, value in enumerate(values):
            if value is not None:
                total[i] += weight * value
                unscorable[i] = False
    return total, unscorable


def is_process_reward(fn: Callable[..., Any]) -> bool:
    """A process reward scores each step of a completion (``fn.process = True``) instead of the whole of it."""
    base = fn.func if isinstance(fn, functools.partial) else fn
    return bool(getattr(base, "process", False))


def step_separator(fn: Callable[..., Any]) -> str:
    """The text that separates steps for a process reward (``fn.step_separator``, default a newline)."""
    base = fn.func if isinstance(fn, functools.partial) else fn
    return getattr(base, "step_separator", "\n")


def _step_checker(separator: str) -> Callable[[str, Any, Sequence[str]], list[list[float]]]:
    """``check`` for :func:`call_reward`: one finite number per step of every completion."""

    def check(name: str, values: Any, completions: Sequence[str]) -> list[list[float]]:
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            raise RewardError(f"process reward {name!r} must return one list of step rewards per completion")
        for i, steps in enumerate(values):
            expected = len(completions[i].split(separator))
            if not isinstance(steps, (list, tuple)) or len(steps) != expected:
                raise RewardError(
                    f"process reward {name!r} returned {steps!r} for completion {i} ({completions[i][:80]!r}), "
                    f"which has {expected} steps separated by {separator!r}"
                )
            for value in steps:
                if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                    raise RewardError(f"process reward {name!r} returned a non-finite or non-number step reward")
        return [[float(v) for v in steps] for steps in values]

    return check


def score_steps(
    specs: Sequence[RewardSpec],
    fns: Sequence[Callable[..., list]],
    prompts: list[Any],
    completions: list[str],
    columns: dict[str, list[Any]],
    *,
    on_error: Literal["raise", "zero"] = "raise",
    timeout_s: float | None = None,
    context: dict[str, Any] | None = None,
) -> list[list[float]]:
    """Weighted sum of the process rewards: for each completion, one reward per step.

    The steps of a completion are ``completion.split(separator)``; each process reward function returns, for
    every completion, a list with one number per step (DeepSeekMath §4.1.3 process supervision). Calls, failures
    and time limits are those of outcome rewards (:func:`score`); zeros are one 0 per step.
    """
    call = RewardCall.of(prompts, completions, columns, context)
    terms = []
    for spec, fn in zip(specs, fns):
        separator = step_separator(fn)
        zeros = lambda separator=separator: [[0.0] * len(c.split(separator)) for c in completions]  # noqa: E731
        terms.append(RewardTerm(spec, fn, _step_checker(separator), zeros))
    totals: list[list[float]] | None = None
    for spec, values in zip(specs, run_terms(terms, call, on_error=on_error, timeout_s=timeout_s)):
        weighted = [[spec.weight * v for v in steps] for steps in values]
        totals = weighted if totals is None else [[a + b for a, b in zip(t, w)] for t, w in zip(totals, weighted)]
    return totals or []
