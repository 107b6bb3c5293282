"""The advantage registry: a name (or a user's import path) → the estimator or reward aggregation that makes a round's
advantages, as ``losses/registry.py`` does for policy losses. The formulas are the pure functions of ``advantages.py``;
the entries here say which of ``data.advantage``'s settings each one reads and what it does not combine with.

The contracts::

    estimator(inputs: AdvantageInputs, *, <settings>) -> advantages [N]
    aggregation(inputs: AdvantageInputs, estimate, *, <settings>) -> advantages [N]

An estimator turns the rewards of a rollout's groups into one advantage per completion (``data.advantage.estimator``:
``grpo``, ``passk``). An aggregation (``data.advantage.multi_objective_aggregation``) says how several reward columns
meet it: ``sum_then_normalize`` hands the weighted totals to ``estimate`` (the estimator with its settings bound),
``normalize_then_sum`` (GDPO) normalises each column itself. ``<settings>`` are keyword parameters named after
``data.advantage``'s fields (``ADVANTAGE_SETTINGS``); the config passes the ones a function names, and refuses a
value set for a setting that neither the estimator nor the aggregation reads (it would be ignored). A rule between
settings (pass@k's k within the group) is the ``check`` given at registration: ``check(values, group_size)``, given
every field of ``data.advantage`` (``group_size`` None while the config is read, the group size before training),
raising ``ValueError`` in one line that starts with the field's name.

A user's estimator: ``@register_advantage_estimator("name")`` in a module imported before the config is read, or
``data.advantage.estimator: my_pkg.module:function`` (imported when the config is read).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from grpo_lightning.advantages import batch_normalized, decoupled_sum, group_advantages, passk_advantages
from grpo_lightning.plugins import load_plugin

ADVANTAGE_SETTINGS = ("baseline", "scale", "std", "eps", "k")
"""``data.advantage`` fields an estimator or aggregation may read by naming them as keyword parameters."""
PROCESS_SETTINGS = ("std", "eps")
"""The settings process (step) rewards' advantages read (``process_advantages``), beside any estimator's."""

Estimate = Callable[["AdvantageInputs"], Tensor]


@dataclass(frozen=True)
class AdvantageInputs:
    """What a round gives an estimator: its rollout's rewards, one per trajectory, ordered group by group."""

    rewards: Tensor
    """``[N]`` each completion's total: its reward columns' weighted sum (None left out)."""
    group_size: int
    """G, completions per prompt (>= 2)."""
    unscorable: Tensor | None = None
    """``[N]`` bool, True where no reward column scores the completion; None: all are scored."""
    reward_columns: Mapping[str, Sequence[float | None]] = field(default_factory=dict)
    """Each reward column's values (``reward_name`` → ``[N]``, None where it does not apply)."""
    weight_of: Callable[[str], float] = lambda name: 1.0
    """A reward column's weight, the one the totals were summed with (the round gives ``rewards.combine.column_weight``
    of the rollout's sources; asked only by an entry that reads the columns)."""
    all_gather: Callable[[Tensor], Tensor] | None = None
    """Collects a tensor from every rank (``[ranks, ...]``); None in a single process."""

    @property
    def scorable(self) -> Tensor | None:
        """``[N]`` bool, the complement of ``unscorable``; None: all are scored."""
        return None if self.unscorable is None else ~self.unscorable

    def gathered_std(self, std: str) -> Tensor | None:
        """The std of every rank's scored rewards, for ``scale: batch``; None in a single process (the estimator
        then takes its own rewards' std). No row of any rank scored: 0 (every advantage is 0 then)."""
        if self.all_gather is None:
            return None
        rewards = self.rewards.float()
        if self.unscorable is not None:  # NaN: left out of the batch's std, as out of the groups'
            rewards = torch.where(self.unscorable, torch.nan, rewards)
        gathered = self.all_gather(rewards).flatten()
        scored = gathered[~gathered.isnan()]
        return scored.std(unbiased=std == "sample") if scored.numel() else scored.new_zeros(())

    def column_matrix(self) -> tuple[Tensor, Tensor]:
        """The reward columns as ``[N, K]`` (NaN where a column does not apply, and on every column of an unscorable
        row: the scorer's rule) and their weights ``[K]``, in the rewards' dtype and device."""
        names = list(self.reward_columns)
        values = [[torch.nan if v is None else v for v in self.reward_columns[name]] for name in names]
        matrix = torch.tensor(values, dtype=self.rewards.dtype, device=self.rewards.device).T
        if self.unscorable is not None:
            matrix = torch.where(self.unscorable.to(matrix.device)[:, None], torch.nan, matrix)
        weights = torch.tensor([self.weight_of(name) for name in names], dtype=matrix.dtype, device=matrix.device)
        return matrix, weights


Check = Callable[[Mapping[str, Any], int | None], None]


@dataclass(frozen=True)
class AdvantageEntry:
    """A registered estimator or aggregation.

    Attributes:
        field: the ``data.advantage`` field that names it (``estimator`` or ``multi_objective_aggregation``).
        name: its name there (or the import path of a user's function).
        fn: the function (see the module docstring for the contracts).
        process_rewards: its advantages combine with process (step) rewards' per-token ones (added to each token).
        check: refuses settings it cannot work with, ``check(values, group_size)`` (see the module docstring).
        source: the paper (or peer) it follows, for docs.
        leading: how many positional parameters come before the settings (1: ``inputs``; 2: ``inputs, estimate``).
    """

    field: str
    name: str
    fn: Callable[..., Tensor]
    process_rewards: bool = False
    check: Check | None = None
    source: str = ""
    leading: int = 1

    @cached_property
    def settings(self) -> tuple[str, ...]:
        """The ``data.advantage`` settings it reads: its parameters after the leading positional ones."""
        return tuple(list(inspect.signature(self.fn).parameters)[self.leading :])

    def call(self, *inputs: Any, settings: Mapping[str, Any]) -> Tensor:
        """``fn(*inputs, **the settings it reads)``."""
        return self.fn(*inputs, **{name: settings[name] for name in self.settings})


class _Registry:
    """The entries of one ``data.advantage`` field, their built-in names, and the lookup by name or import path."""

    def __init__(self, field: str, positional: tuple[str, ...]) -> None:
        self.field, self.positional = field, positional
        self.entries: dict[str, AdvantageEntry] = {}
        self.built_in: tuple[str, ...] = ()

    def register(self, entry: AdvantageEntry) -> None:
        taken = self.entries.get(entry.name)
        if taken is not None and _origin(taken.fn) != _origin(entry.fn):  # the same function re-imported: replaced
            raise ValueError(f"an {self.field} is already registered as {entry.name!r}")
        self.check_signature(entry)
        self.entries[entry.name] = entry

    def get(self, name: str) -> AdvantageEntry:
        if name in self.entries:
            return self.entries[name]
        if ":" not in name:
            raise ValueError(f"{self.field} must be {self.choices()} (got {name!r})")
        try:
            fn = load_plugin(name)
        except (ImportError, AttributeError, ValueError) as err:
            raise ValueError(f"{self.field} {name!r} cannot be imported: {err}") from None
        registered = next((entry for entry in self.entries.values() if entry.fn is fn), None)
        entry = registered or AdvantageEntry(self.field, name, fn, leading=len(self.positional))
        self.check_signature(entry)
        return entry

    def choices(self) -> str:
        """The names a config may give, for messages: the built-in ones, the others registered, an import path."""
        users = sorted(set(self.entries) - set(self.built_in))
        registered = f", one registered ({', '.join(users)})" if users else ""
        return f"{' or '.join(self.built_in)}{registered}, or an import path package.module:function"

    def check_signature(self, entry: AdvantageEntry) -> None:
        what = f"{self.field} {entry.name!r}"
        if not callable(entry.fn):
            raise ValueError(f"{what} is not callable")
        try:
            parameters = list(inspect.signature(entry.fn).parameters.values())
        except (TypeError, ValueError):
            raise ValueError(f"{what} has no inspectable signature") from None
        form = f"fn({', '.join(self.positional)}, *, setting=default, ...) with settings among {ADVANTAGE_SETTINGS}"
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        leading = parameters[: len(self.positional)]
        if len(leading) < len(self.positional) or any(p.kind not in positional for p in leading):
            raise ValueError(f"{what} must take {', '.join(self.positional)} positionally: {form}")
        for parameter in parameters[len(self.positional) :]:
            if parameter.kind in positional and parameter.default is inspect.Parameter.empty:
                raise ValueError(f"{what}: parameter {parameter.name!r} after inputs must be a keyword setting: {form}")
            if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                raise ValueError(f"{what}: {parameter} is not allowed: {form}")
            if parameter.name not in ADVANTAGE_SETTINGS:
                raise ValueError(f"{what}: parameter {parameter.name!r} is not a setting of data.advantage: {form}")


def _origin(fn: Callable[..., Tensor]) -> tuple[str, str]:
    """Where a function is defined: a module imported again defines a new object at the same place."""
    return getattr(fn, "__module__", ""), getattr(fn, "__qualname__", repr(fn))


_ESTIMATORS = _Registry("estimator", ("inputs",))
_AGGREGATIONS = _Registry("multi_objective_aggregation", ("inputs", "estimate"))


def _decorator(registry: _Registry, name: str, process_rewards: bool, check: Check | None, source: str):
    def decorator(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        leading = len(registry.positional)
        registry.register(AdvantageEntry(registry.field, name, fn, process_rewards, check, source, leading))
        return fn

    return decorator


def register_advantage_estimator(
    name: str, *, process_rewards: bool = False, check: Check | None = None, source: str = ""
) -> Callable[[Callable[..., Tensor]], Callable[..., Tensor]]:
    """Decorator: make ``fn(inputs: AdvantageInputs, *, <settings>) -> [N]`` the ``data.advantage.estimator``
    named ``name``.

    ``fn`` returns one advantage per trajectory of ``inputs.rewards`` (same order; groups of ``inputs.group_size``
    adjacent); its keyword parameters name the ``data.advantage`` fields it reads (``ADVANTAGE_SETTINGS``), given
    their configured values. A field set to other than its default that neither the estimator nor the aggregation
    reads is refused before training.

    Args:
        name: the name ``data.advantage.estimator`` gives.
        process_rewards: its advantages may be summed with process rewards' per-token ones (else a process reward
            is refused with it before training).
        check: ``check(values, group_size)``, refusing settings it cannot work with (module docstring).
        source: the paper (or peer) it follows, for docs.

    Raises:
        ValueError: ``name`` is registered already to another function, or ``fn``'s signature does not follow the
            contract.
    """
    return _decorator(_ESTIMATORS, name, process_rewards, check, source)


def register_reward_aggregation(
    name: str, *, process_rewards: bool = False, check: Check | None = None, source: str = ""
) -> Callable[[Callable[..., Tensor]], Callable[..., Tensor]]:
    """Decorator: make ``fn(inputs, estimate, *, <settings>) -> [N]`` the ``data.advantage.multi_objective_aggregation``
    named ``name``; ``estimate(inputs)`` is the configured estimator with its settings.

    Args:
        name: the name ``data.advantage.multi_objective_aggregation`` gives.
        process_rewards: as ``register_advantage_estimator``'s.
        check: as ``register_advantage_estimator``'s.
        source: as ``register_advantage_estimator``'s.
    """
    return _decorator(_AGGREGATIONS, name, process_rewards, check, source)


def available_advantage_estimators() -> list[str]:
    """The registered estimator names."""
    return sorted(_ESTIMATORS.entries)


def available_reward_aggregations() -> list[str]:
    """The registered aggregation names."""
    return sorted(_AGGREGATIONS.entries)


def get_advantage_estimator(name: str) -> AdvantageEntry:
    """The estimator registered as ``name``, or the function at the import path ``package.module:function``
    (``ValueError`` in one line, starting with ``estimator``, otherwise)."""
    return _ESTIMATORS.get(name)


def get_reward_aggregation(name: str) -> AdvantageEntry:
    """The aggregation registered as ``name`` (or at an import path), as ``get_advantage_estimator``."""
    return _AGGREGATIONS.get(name)


def check_advantage_settings(
    values: Mapping[str, Any], defaults: Mapping[str, Any], group_size: int | None = None
) -> tuple[AdvantageEntry, AdvantageEntry]:
    """Look up ``values["estimator"]`` and ``values["multi_objective_aggregation"]`` and refuse what they cannot work
    with: their own rules, then a setting set away from its default (``defaults``) that neither reads (``std`` and
    ``eps`` count as read with an estimator that takes process rewards: theirs read them). ``ValueError`` in one line
    starting with the field's name. Returns the estimator and the aggregation."""
    estimator = get_advantage_estimator(values["estimator"])
    aggregation = get_reward_aggregation(values["multi_objective_aggregation"])
    if estimator.check is not None:
        estimator.check(values, group_size)
    read = {*estimator.settings, *aggregation.settings, *(PROCESS_SETTINGS if estimator.process_rewards else ())}
    for name in ADVANTAGE_SETTINGS:
        if name not in read and values[name] != defaults[name]:
            readers = " or ".join(n for n, entry in _ESTIMATORS.entries.items() if name in entry.settings) or "none"
            default = "null" if defaults[name] is None else defaults[name]
            raise ValueError(f"{name} is read by estimator: {readers} only; leave it {default} (got {values[name]!r})")
    if aggregation.check is not None:
        aggregation.check(values, group_size)
    return estimator, aggregation


def estimate_advantages(inputs: AdvantageInputs, settings: Mapping[str, Any]) -> Tensor:
    """The advantages ``[N]`` that ``settings`` (every field of ``data.advantage``) name: the aggregation called
    with the estimator, each given the settings it reads."""
    estimator = get_advantage_estimator(settings["estimator"])
    aggregation = get_reward_aggregation(settings["multi_objective_aggregation"])
    return aggregation.call(inputs, lambda given: estimator.call(given, settings=settings), settings=settings)


# --- the built-in entries ------------------------------------------------------------------------------------------


@register_advantage_estimator("grpo", process_rewards=True, source="DeepSeekMath §4.1.2; RLOO; Dr. GRPO")
def grpo(inputs: AdvantageInputs, *, baseline: str, scale: str, std: str, eps: float) -> Tensor:
    """Group-relative advantages (``advantages.group_advantages``), ``scale: batch`` over every rank's rewards."""
    batch_std = inputs.gathered_std(std) if scale == "batch" else None
    return group_advantages(
        inputs.rewards,
        inputs.group_size,
        baseline=baseline,
        scorable=inputs.scorable,
        scale=scale,
        eps=eps,
        batch_std=batch_std,
        std=std,
    )


def _passk_rules(values: Mapping[str, Any], group_size: int | None) -> None:
    k = values["k"]
    if k is not None and (type(k) is not int or k < 2):
        raise ValueError(
            f"k must be an integer >= 2 (got {k!r}): with one attempt there is no best of the others to beat "
            "(pass@1 is estimator: grpo)"
        )
    if values["baseline"] != "mean":
        raise ValueError(
            f"baseline: {values['baseline']} does not apply to estimator: passk, whose baseline is the best of the "
            "other attempts; leave baseline: mean"
        )
    if group_size is not None and (k or group_size) > group_size:
        raise ValueError(
            f"k must be at most data.sampling.group_size={group_size} (got {k}): pass@k draws its k attempts from a "
            "group's completions"
        )


@register_advantage_estimator("passk", check=_passk_rules, source="Tang et al. 2025; verl grpo_passk")
def passk(inputs: AdvantageInputs, *, scale: str, std: str, eps: float, k: int | None) -> Tensor:
    """Pass@k advantages (``advantages.passk_advantages``), ``scale: batch`` over every rank's rewards."""
    batch_std = inputs.gathered_std(std) if scale == "batch" else None
    return passk_advantages(
        inputs.rewards,
        inputs.group_size,
        k,
        scorable=inputs.scorable,
        scale=scale,
        eps=eps,
        batch_std=batch_std,
        std=std,
    )


@register_reward_aggregation("sum_then_normalize", process_rewards=True, source="GRPO; TRL")
def sum_then_normalize(inputs: AdvantageInputs, estimate: Estimate) -> Tensor:
    """The estimator's advantages of the weighted totals (with no reward column: all 0 and unscorable)."""
    return estimate(inputs)


def _gdpo_rules(values: Mapping[str, Any], group_size: int | None) -> None:
    if values["estimator"] != "grpo":
        raise ValueError(
            f"multi_objective_aggregation: normalize_then_sum does not combine with estimator: {values['estimator']} "
            "(GDPO normalises each reward column within its group itself, as estimator: grpo); use sum_then_normalize"
        )
    if (values["scale"], values["baseline"]) != ("group", "mean"):
        raise ValueError(
            "multi_objective_aggregation: normalize_then_sum (GDPO) fixes its own baseline and scale (each reward's "
            "group mean and std, then the batch's, as TRL does whatever its scale_rewards); leave baseline: mean and "
            f"scale: group (got {values['baseline']}, {values['scale']})"
        )


@register_reward_aggregation("normalize_then_sum", check=_gdpo_rules, source="GDPO (Liu et al. 2026); TRL 1.16")
def normalize_then_sum(inputs: AdvantageInputs, estimate: Estimate, *, std: str, eps: float) -> Tensor:
    """GDPO: every reward column normalised within its group, summed with its weight, the sum normalised over the
    batch of all ranks (``advantages.decoupled_sum``, ``advantages.batch_normalized``). A None (not applicable) is
    NaN, as in TRL: out of that reward's group mean and std; a completion no column applies to is out of the batch's
    too, with advantage 0. Without any reward column (a teacher alone): the estimator's."""
    if not inputs.reward_columns:
        return estimate(inputs)
    rewards, weights = inputs.column_matrix()
    summed = decoupled_sum(rewards, weights, inputs.group_size, eps=eps, std=std)
    every_rank = inputs.all_gather(summed).flatten() if inputs.all_gather is not None else None
    return batch_normalized(summed, eps=eps, std=std, batch=every_rank)


_ESTIMATORS.built_in = tuple(_ESTIMATORS.entries)
_AGGREGATIONS.built_in = tuple(_AGGREGATIONS.entries)
