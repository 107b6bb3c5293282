"""The policy-loss registry: a name (or a user's import path) → the function and what its paper fixes.

The contract every policy loss follows::

    fn(inputs: LossInputs, *, <settings with defaults>) -> (per_token [B, T], metrics {name: scalar})

``per_token`` is the loss to minimise at each token before aggregation (the objective then applies the sampler
correction, the off-policy mask, the KL and entropy terms and the aggregation); ``metrics`` are detached scalars
logged as ``train/<name>``. Settings are keyword parameters with defaults: the generic ones are read from
``model.objective`` by name (``GENERIC_SETTINGS``; left unset there, the function's own default applies), any
other from ``model.objective.loss_kwargs``. A function names only the settings it reads, so a setting given for a
loss that does not read it is refused instead of ignored.

Each loss declares the values its settings take with ``@setting_ranges`` (``ranges.py``): a user's function by
import path as a built-in one, e.g. ``@setting_ranges(cap=Range("(0, inf)", "a weight cap"))`` or the interval
alone, ``cap="(0, inf)"``. A value outside is refused with the setting, the loss and the range, e.g.
``model.objective.epsilon_low = 1.2 is outside loss_type 'grpo''s range [0, 1) (...)``; a generic setting read
without a declared range keeps ``GENERIC_RANGES``. A rule between settings (Clip-Cov's lower bound below its upper
one) is a function on the loss, ``fn.check_settings(settings)``, given every setting (the defaults filled in) and
raising ``SettingOutOfRange`` or ``ValueError`` in one line.

Built-in losses register with ``@register_policy_loss`` when the package is imported (its ``__init__`` imports
the families after this module, which imports none of them); a config names one, or a function by import path
(``my_pkg.losses:my_loss``), checked with ``check_policy_loss`` when the config is read (``ObjectiveConfig``) and
at every call of ``grpo_loss``.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from types import ModuleType
from typing import Any

from torch import Tensor

from grpo_lightning.losses.aggregation import AGGREGATIONS
from grpo_lightning.losses.inputs import LossInputs
from grpo_lightning.losses.ranges import GENERIC_RANGES, Range

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]

GENERIC_SETTINGS = ("epsilon_low", "epsilon_high", "delta", "clip_ratio_c", "importance_sampling_level")
"""``model.objective`` fields a loss may read by naming them as parameters (``None`` there: the loss's default)."""


class SettingOutOfRange(ValueError):
    """A loss setting outside the range its loss declares; the message starts with the setting's name."""


@dataclass(frozen=True)
class PolicyLoss:
    """A registered loss: its function and what its definition fixes.

    Attributes:
        name: the config name (or the import path of a user's function).
        fn: the function (see the module docstring for the contract).
        aggregation: the default aggregation.
        aggregations: those allowed; one entry when the paper's objective fixes it.
        level: the ratio the loss is defined on when it fixes one (``"sequence"``), else ``None`` (it reads
            ``importance_sampling_level``, default ``"token"``); used for the logged ratio statistics.
        corrects_sampler: the loss folds the engine's importance weights in itself (``LossInputs.is_weights``),
            so the objective must not multiply by them again.
        micro_batch_statistics: the loss selects tokens by statistics of the call's tokens (verl's Clip-Cov and
            KL-Cov: a covariance over the micro-batch, a number of tokens in proportion to it), so that its step,
            whatever the aggregation, depends on how the step's rows are split into micro-batches and ranks.
        source: the paper (or peer) the definition and its fixed choices follow, for messages and docs.
    """

    name: str
    fn: PolicyLossFn
    aggregation: str
    aggregations: tuple[str, ...] = AGGREGATIONS
    level: str | None = None
    corrects_sampler: bool = False
    source: str = ""
    micro_batch_statistics: bool = False

    @cached_property
    def parameters(self) -> dict[str, inspect.Parameter]:
        """The keyword settings of ``fn`` (everything after ``inputs``)."""
        return dict(list(inspect.signature(self.fn).parameters.items())[1:])

    @property
    def ranges(self) -> dict[str, Range]:
        """The range of each setting that has one: the function's declared ``setting_ranges`` (read at each use,
        so that ``@setting_ranges`` may sit above or below ``@register_policy_loss``), and ``GENERIC_RANGES`` for a
        generic setting it reads (by name, or through ``**kwargs``) without declaring one."""
        declared = dict(getattr(self.fn, "setting_ranges", None) or {})
        for key, value in declared.items():
            if not isinstance(value, Range):
                raise ValueError(f"loss_type {self.name!r}: the range of {key!r} must be a Range (got {value!r})")
            if key not in self.parameters and not self.takes_any:
                raise ValueError(f"loss_type {self.name!r} declares a range for {key!r}, not one of its settings")
        generic = {key: GENERIC_RANGES[key] for key in GENERIC_RANGES if key in self.parameters or self.takes_any}
        return {**generic, **declared}

    @property
    def takes_any(self) -> bool:
        return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in self.parameters.values())

    def ratio_level(self, requested: str | None) -> str:
        """The ratio level in use: the loss's fixed one, the requested one, or its parameter's default."""
        if self.level is not None:
            return self.level
        if requested is not None:
            return requested
        parameter = self.parameters.get("importance_sampling_level")
        default = None if parameter is None else parameter.default
        return default if isinstance(default, str) else "token"

    def settings_for(self, generic: dict[str, Any], loss_kwargs: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments of a call: the generic settings that are set (not ``None``) and ``loss_kwargs``."""
        return {**{k: v for k, v in generic.items() if v is not None}, **loss_kwargs}

    def check(self, generic: dict[str, Any], loss_kwargs: dict[str, Any], aggregation: str | None) -> None:
        """Refuse, in one line, settings this loss does not read, missing required ones or a contradicting
        aggregation."""
        if aggregation is not None and aggregation not in self.aggregations:
            fixed = f"fixes {self.aggregations[0]}" if len(self.aggregations) == 1 else f"allows {self.aggregations}"
            raise ValueError(
                f"aggregation {aggregation!r} contradicts loss_type {self.name!r}: its objective{self._cite()} {fixed}"
            )
        known = list(self.parameters)
        if not self.takes_any:
            for key, value in {**generic, **loss_kwargs}.items():
                if value is not None and key not in self.parameters:
                    where = "loss_kwargs." if key in loss_kwargs else ""
                    raise ValueError(
                        f"{where}{key} is not a setting of loss_type {self.name!r} (its settings: "
                        f"{', '.join(known) or 'none'})"
                    )
        for key in loss_kwargs:
            if key in GENERIC_SETTINGS:
                raise ValueError(f"loss_kwargs.{key}: set {key} directly under model.objective")
        given = self.settings_for(generic, loss_kwargs)
        for key, parameter in self.parameters.items():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                continue
            if parameter.default is inspect.Parameter.empty and key not in given:
                raise ValueError(f"loss_type {self.name!r} needs {key}: set it in model.objective.loss_kwargs")
        self.check_ranges(given, loss_kwargs)
        rule = getattr(self.fn, "check_settings", None)
        if rule is not None:
            defaults = {k: p.default for k, p in self.parameters.items() if p.default is not inspect.Parameter.empty}
            rule({**defaults, **given})

    def check_ranges(self, given: dict[str, Any], loss_kwargs: dict[str, Any]) -> None:
        """Refuse a given setting outside its declared range (``SettingOutOfRange``, one line). ``None`` passes
        where it is the function's own default (a setting's "off")."""
        ranges = self.ranges
        for key, value in given.items():
            allowed = ranges.get(key)
            parameter = self.parameters.get(key)
            if allowed is None or (value is None and parameter is not None and parameter.default is None):
                continue
            if not allowed.accepts(value):
                where = "loss_kwargs." if key in loss_kwargs else ""
                loss = f"loss_type {self.name!r}"
                raise SettingOutOfRange(f"{where}{key} = {value!r} is outside {loss}'s range {allowed}")

    def __call__(
        self, inputs: LossInputs, generic: dict[str, Any], loss_kwargs: dict[str, Any]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        return self.fn(inputs, **self.settings_for(generic, loss_kwargs))

    def _cite(self) -> str:
        return f" ({self.source})" if self.source else ""


_REGISTRY: dict[str, PolicyLoss] = {}
# Import paths already resolved, with their module: the loss is looked up at every micro-batch.
_IMPORTED: dict[str, tuple[ModuleType, PolicyLoss]] = {}


def register_policy_loss(
    name: str,
    *,
    aggregation: str,
    fixed: bool = False,
    level: str | None = None,
    corrects_sampler: bool = False,
    source: str = "",
    micro_batch_statistics: bool = False,
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: make ``fn`` (the contract of the module docstring) the ``model.objective.loss_type`` ``name``.

    The ranges of its settings are declared on the function with ``@setting_ranges`` (``ranges.py``), as a user's
    loss declares them. The signature is checked here: ``inputs`` first, then keyword settings with defaults.

    Args:
        name: the name configs give.
        aggregation: how its per-token losses become one number by default (``losses/aggregation.py``:
            ``sequence_mean``, ``token_mean``, ``micro_batch_token_mean``, ``constant``, ``sequence_sum``).
        fixed: the paper defines the loss with ``aggregation``, and ``model.objective.aggregation`` may not change
            it (another value is refused before training).
        level: ``"sequence"`` when the loss is defined on the sequence ratio (GSPO's s_i), whatever
            ``importance_sampling_level`` says; None: it reads that setting (default ``token``).
        corrects_sampler: the loss weighs its terms by the engine's importance weights itself
            (``LossInputs.is_weights``), so the objective does not multiply by them again.
        source: the paper (or peer) the definition follows, shown in messages and docs.
        micro_batch_statistics: the loss picks tokens by statistics of the call's tokens (a covariance over the
            micro-batch), so its step depends on how the rows are split into micro-batches and ranks.

    Raises:
        ValueError: ``aggregation`` is unknown, ``name`` is registered already to another function, or ``fn``'s
            signature or declared ranges do not follow the contract.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in _REGISTRY and _REGISTRY[name].fn is not fn:
            raise ValueError(f"a policy loss is already registered as {name!r}")
        allowed = (aggregation,) if fixed else AGGREGATIONS
        spec = PolicyLoss(name, fn, aggregation, allowed, level, corrects_sampler, source, micro_batch_statistics)
        _check_signature(spec)
        _REGISTRY[name] = spec
        return fn

    return decorator


def available_policy_losses() -> list[str]:
    """The registered loss names."""
    return sorted(_REGISTRY)


def get_policy_loss(name: str) -> PolicyLoss:
    """The loss registered as ``name``, or the function at the import path ``package.module:function``.

    A user's function not registered under a name gets the defaults of a per-token loss: ``sequence_mean``
    aggregation (GRPO's), any aggregation allowed, the sampler correction applied by the objective.
    """
    if name in _REGISTRY:
        return _REGISTRY[name]
    module_name, _, attr = name.rpartition(":") if ":" in name else name.rpartition(".")
    if name in _IMPORTED and sys.modules.get(module_name) is _IMPORTED[name][0]:
        return _IMPORTED[name][1]
    if ":" not in name and "." not in name:
        raise ValueError(
            f"unknown loss_type {name!r}: use one of {', '.join(sorted(_REGISTRY))} or an import path "
            "package.module:function"
        )
    try:
        module = importlib.import_module(module_name)
        fn = getattr(module, attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"loss_type {name!r} cannot be imported: {err}") from None
    registered = next((spec for spec in _REGISTRY.values() if spec.fn is fn), None)
    spec = registered or PolicyLoss(name, fn, "sequence_mean")
    _check_signature(spec)
    _IMPORTED[name] = (module, spec)
    return spec


def _check_signature(spec: PolicyLoss) -> None:
    if not callable(spec.fn):
        raise ValueError(f"loss_type {spec.name!r} is not callable")
    try:
        parameters = list(inspect.signature(spec.fn).parameters.values())
    except (TypeError, ValueError):
        raise ValueError(f"loss_type {spec.name!r} has no inspectable signature") from None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not parameters or parameters[0].kind not in positional:
        raise ValueError(
            f"loss_type {spec.name!r} must take the LossInputs as its first positional parameter: "
            "fn(inputs, *, setting=default, ...) -> (per_token_loss, metrics)"
        )
    _ = spec.ranges  # a range declared for no setting of the function fails now, not at the first check
    for parameter in parameters[1:]:
        if parameter.kind in positional and parameter.default is inspect.Parameter.empty:
            raise ValueError(
                f"loss_type {spec.name!r}: parameter {parameter.name!r} after inputs must be a keyword setting "
                "(fn(inputs, *, setting=default, ...))"
            )
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            raise ValueError(f"loss_type {spec.name!r}: *{parameter.name} is not allowed; settings are keywords")


def check_policy_loss(
    loss_type: str, generic: dict[str, Any], loss_kwargs: dict[str, Any] | None, aggregation: str | None
) -> PolicyLoss:
    """Resolve ``loss_type`` and check the settings against it (one-line ``ValueError``); return the loss."""
    spec = get_policy_loss(loss_type)
    spec.check(generic, dict(loss_kwargs or {}), aggregation)
    return spec
