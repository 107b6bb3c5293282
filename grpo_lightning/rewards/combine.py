"""Score completions with several reward functions and combine them into one reward per completion.

Also home of :func:`time_limit`, the per-call time limit that ``score(..., timeout_s=...)`` and the math
reward's sympy checks use.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal


class RewardError(RuntimeError):
    """A reward function is misconfigured or returned something unusable. The message names the function."""


@dataclass
class RewardSpec:
    """One term of the reward: a registered name (or import path), its weight and keyword arguments."""

    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self) -> Callable[..., list]:
        from grpo_lightning.rewards import get

        fn = get(self.name)
        check = getattr(fn, "check_kwargs", None)
        if check is not None:
            check(**self.kwargs)  # the function refuses settings that cannot work now, before training starts
        return functools.partial(fn, **self.kwargs) if self.kwargs else fn


class TimeLimitExceeded(BaseException):
    """Raised inside code that ran past a :func:`time_limit`.

    A ``BaseException`` (like ``KeyboardInterrupt``) so that a reward function's own ``except Exception`` does not
    swallow it.
    """

    def __init__(self, seconds: float, token: object = None) -> None:
        super().__init__(f"ran longer than {seconds:g}s")
        self.seconds, self.token = seconds, token


def alarm_available() -> bool:
    """Whether :func:`time_limit` can interrupt code here: POSIX ``setitimer``, called from the main thread."""
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[object | None]:
    """Raise :class:`TimeLimitExceeded` in the block when it runs longer than ``seconds`` (wall clock).

    Uses ``SIGALRM`` via ``setitimer``, so it works only in the main thread (check :func:`alarm_available`;
    elsewhere the block runs without a limit) and interrupts Python code, not one long C call. Limits nest: an
    outer limit that expires first still fires, and the outer timer is re-armed when the inner block ends. The
    block gets a token (None when no timer of its own was set): ``err.token is token`` tells this limit's
    expiry from an enclosing one's.
    """
    if seconds is None or seconds <= 0 or not alarm_available():
        yield None
        return
    outer_remaining, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    if outer_remaining and outer_remaining <= seconds:
        yield None  # the enclosing limit ends first and raises its own exception
        return
    token = object()
    closed = [False]

    def on_alarm(signum: int, frame: Any) -> None:
        handling = sys.exc_info()[1]
        if closed[0] or (isinstance(handling, TimeLimitExceeded) and handling.token is token):
            return  # the block is ending, or this limit's exception is already on its way out of it
        raise TimeLimitExceeded(seconds, token)

    start = time.monotonic()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    # Fires again every ``min(seconds, 0.1)`` until the block ends. Why: Python discards an exception raised inside a
    # finalizer (``__del__``, weakref callbacks, run by the garbage collector at any allocation) or C code that
    # clears errors; the alarm lands there now and then, and a one-shot timer then let the block run to its end
    # (a sympy check limited to 0.3 s ran its full 7 s in the test suite, among torch's and Lightning's objects).
    signal.setitimer(signal.ITIMER_REAL, seconds, min(seconds, 0.1))
    try:
        yield token
    finally:
        closed[0] = True  # first: no further alarm raises, whatever is pending
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_remaining:
            remaining = max(outer_remaining - (time.monotonic() - start), 1e-4)
            signal.setitimer(signal.ITIMER_REAL, remaining, outer_interval)


def call_with_time_limit(fn: Callable[..., Any], seconds: float | None, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, raising :class:`TimeLimitExceeded` after ``seconds``.

    In the main thread the call is interrupted by :func:`time_limit`. Elsewhere it runs in a daemon thread that
    is abandoned (not stopped: Python cannot kill a thread) when the limit passes.
    """
    if seconds is None or seconds <= 0:
        return fn(*args, **kwargs)
    if alarm_available():
        try:
            with time_limit(seconds) as token:
                return fn(*args, **kwargs)
        except TimeLimitExceeded as err:
            if token is not None and err.token is token:
                raise TimeLimitExceeded(seconds) from None
            raise
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as err:  # handed to the caller's thread below
            result["error"] = err

    worker = threading.Thread(target=target, daemon=True, name="reward-time-limit")
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise TimeLimitExceeded(seconds)
    if "error" in result:
        raise result["error"]
    return result["value"]


def _find_slow_completion(
    fn: Callable[..., list], seconds: float, prompts: list[str], completions: list[str], columns: dict[str, list]
) -> int | None:
    """Index of the first completion that alone takes longer than ``seconds``, within a budget of 2 × seconds."""
    deadline = time.monotonic() + 2 * seconds
    for i in range(len(completions)):
        if time.monotonic() > deadline:
            return None
        row = {name: values[i : i + 1] for name, values in columns.items()}
        try:
            call_with_time_limit(fn, seconds, prompts[i : i + 1], completions[i : i + 1], **row)
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


def call_reward(
    spec: RewardSpec,
    fn: Callable[..., Any],
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list[Any]],
    *,
    check: Callable[[str, Any, Sequence[str]], list],
    zeros: Callable[[], list],
    on_error: Literal["raise", "zero"] = "raise",
    timeout_s: float | None = None,
) -> list:
    """One reward function's values for a batch, checked by ``check``; the same failure handling for every kind.

    A function that raises, returns something unusable (``RewardError``) or runs past ``timeout_s`` (its call on
    the whole batch, see :func:`call_with_time_limit`) is reported with its name, and with the first completion
    that alone also runs past the limit (looked for within 2 × ``timeout_s``); with ``on_error="zero"`` it gives
    ``zeros()`` instead.
    """
    try:
        return check(spec.name, call_with_time_limit(fn, timeout_s, prompts, completions, **columns), completions)
    except TimeLimitExceeded as err:
        if err.token is not None:
            raise  # an enclosing time limit of the caller's ran out, not ours
        if on_error == "zero":
            return zeros()
        assert timeout_s is not None
        slow = _find_slow_completion(fn, timeout_s, prompts, completions, columns)
        where = (
            f"completion {slow} alone ({completions[slow][:80]!r}) takes longer"
            if slow is not None
            else "no single completion was found to take that long alone"
        )
        raise RewardError(
            f"reward {spec.name!r} ran longer than timeout_s={timeout_s:g}s on a batch of "
            f"{len(completions)} completions; {where}"
        ) from None
    except RewardError:
        if on_error == "zero":
            return zeros()
        raise
    except Exception as err:  # a user's function failed: name it and the data it failed on
        if on_error == "zero":
            return zeros()
        raise RewardError(
            f"reward {spec.name!r} raised {type(err).__name__}: {err} "
            f"(first completion of the batch: {completions[0][:80]!r})"
        ) from err


def score(
    specs: Sequence[RewardSpec],
    fns: Sequence[Callable[..., list]],
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list[Any]],
    *,
    on_error: Literal["raise", "zero"] = "raise",
    timeout_s: float | None = None,
) -> tuple[list[float], dict[str, list[float | None]]]:
    """Run every (outcome) reward function; return the weighted total per completion and each function's values.

    ``None`` (not applicable) counts as 0 in the total and is left out of that function's logged mean. Failures
    are handled by :func:`call_reward`.
    """
    per_function: dict[str, list[float | None]] = {}
    total = [0.0] * len(completions)
    for spec, fn in zip(specs, fns, strict=True):
        values = call_reward(
            spec,
            fn,
            prompts,
            completions,
            columns,
            check=_check_values,
            zeros=lambda: [0.0] * len(completions),
            on_error=on_error,
            timeout_s=timeout_s,
        )
        per_function[spec.name] = values
        for i, value in enumerate(values):
            if value is not None:
                total[i] += spec.weight * value
    return total, per_function


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
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list[Any]],
    *,
    on_error: Literal["raise", "zero"] = "raise",
    timeout_s: float | None = None,
) -> list[list[float]]:
    """Weighted sum of the process rewards: for each completion, one reward per step.

    The steps of a completion are ``completion.split(separator)``; each process reward function returns, for
    every completion, a list with one number per step (DeepSeekMath §4.1.3 process supervision). Failures and
    time limits are handled as for outcome rewards (:func:`call_reward`); zeros are one 0 per step.
    """
    totals: list[list[float]] | None = None
    for spec, fn in zip(specs, fns):
        separator = step_separator(fn)
        values = call_reward(
            spec,
            fn,
            prompts,
            completions,
            columns,
            check=_step_checker(separator),
            zeros=lambda separator=separator: [[0.0] * len(c.split(separator)) for c in completions],
            on_error=on_error,
            timeout_s=timeout_s,
        )
        weighted = [[spec.weight * v for v in steps] for steps in values]
        totals = weighted if totals is None else [[a + b for a, b in zip(t, w)] for t, w in zip(totals, weighted)]
    return totals or []
