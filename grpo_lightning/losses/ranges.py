"""The values a policy loss's settings may take, declared by the loss and checked when the config is read.

Why the loss declares them, not ``model.objective``: one setting means different things to different losses.
``epsilon_low`` puts the clipped losses' lower ratio bound at 1 − ε, which must stay above 0 (ε < 1), while GMPO's
is a bound in log space (e^−ε > 0 for any ε ≥ 0) and CISPO's bounds a weight, where ε = 1 means no lower bound. A
value outside its loss's range would train without a word (a lower clip at or below 0 clips nothing), so it is
refused in one line naming the setting, the loss and the range.

A loss declares its ranges with ``@setting_ranges(name=Range("[0, 1)", "why"), ...)`` (or the interval alone,
``name="(0, inf)"``), built-in or a user's by import path alike; a generic setting (``registry.GENERIC_SETTINGS``)
a loss reads without declaring one keeps ``GENERIC_RANGES``, what ``model.objective`` checked for every loss before.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, TypeVar

_INTERVAL = re.compile(r"\s*([\[(])\s*([^,\s]+)\s*,\s*([^,\s]+)\s*([\])])\s*")
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Range:
    """An interval of numbers in the usual notation (``"[0, 1)"``, ``"(0, inf)"``; ``inf`` for no bound) and why
    the setting must lie in it, both for the one-line message."""

    interval: str
    why: str = ""

    def __post_init__(self) -> None:
        _ = self.bounds  # a malformed interval fails where it is declared

    @cached_property
    def bounds(self) -> tuple[float, float, bool, bool]:
        """``(low, high, low_closed, high_closed)``."""
        match = _INTERVAL.fullmatch(self.interval)
        opening, low, high, closing = match.groups() if match else ("", "nan", "nan", "")
        try:
            bounds = float(low), float(high)
        except ValueError:
            bounds = math.nan, math.nan
        if math.isnan(bounds[0]) or math.isnan(bounds[1]) or bounds[0] > bounds[1]:
            raise ValueError(f"a setting's range is an interval such as '[0, 1)' or '(0, inf)', got {self.interval!r}")
        return bounds[0], bounds[1], opening == "[", closing == "]"

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` is a number (not a bool) inside the interval."""
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            return False
        low, high, low_closed, high_closed = self.bounds
        above = value >= low if low_closed else value > low
        below = value <= high if high_closed else value < high
        return above and below

    def __str__(self) -> str:
        return self.interval + (f" ({self.why})" if self.why else "")


def as_range(value: Range | str) -> Range:
    """``value``, or the interval string as a ``Range``."""
    return value if isinstance(value, Range) else Range(value)


def setting_ranges(**ranges: Range | str) -> Callable[[F], F]:
    """Decorator: declare the ranges of a policy loss's settings (keyword parameters), by setting name.

    The ranges are kept on the function (``fn.setting_ranges``), so a loss given by import path declares its own
    as a registered one does; either decorator order with ``register_policy_loss`` works. A value outside its range
    is refused when the config is read, in one line naming the setting, the loss and the range.

    Args:
        **ranges: each setting's ``Range``, or its interval alone (``"[0, 1)"``, ``"(0, inf)"``).
    """
    declared = {name: as_range(value) for name, value in ranges.items()}

    def decorator(fn: F) -> F:
        fn.setting_ranges = {**getattr(fn, "setting_ranges", {}), **declared}  # type: ignore[attr-defined]
        return fn

    return decorator


GENERIC_RANGES: dict[str, Range] = {
    "epsilon_low": Range("[0, inf)", "a clip range is a distance from ratio 1"),
    "epsilon_high": Range("[0, inf)", "a clip range is a distance from ratio 1"),
    "delta": Range("(1, inf)", "it caps the ratio from above"),
    "clip_ratio_c": Range("(1, inf)", "the dual clip bounds a negative advantage's loss by c·|A|, c > 1"),
}
"""The ranges of the generic settings for a loss that reads one without declaring its own."""
