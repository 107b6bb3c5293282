"""Policy losses after GRPO, each a pure tensor function readable against its paper, behind a registry.

Rooms: ``inputs`` (what a loss reads, the ratios), ``registry`` (name or import path → loss), ``ranges`` (the
values each loss's settings take), one file per family (``clipped``: grpo, dapo, dr_grpo, bnpo, luspo; ``cispo``;
``sapo``; ``gmpo``; ``vespo``; ``covariance``: verl's clip_cov, kl_cov), ``kl`` (estimators), ``entropy`` (the
top-entropy-quantile mask, the adaptive entropy coefficient), ``aggregation`` (how per-token losses become one
number) and ``objective`` (``grpo_loss``, which assembles them with the sampler correction, the off-policy mask, the
KL and the entropy terms). Advantages are in ``grpo_lightning.advantages``.

A user's loss: ``model.objective.loss_type: my_pkg.losses:my_loss`` with ``my_loss(inputs: LossInputs, *,
setting=default, ...) -> (per_token_loss [B, T], metrics)``, its settings' ranges declared with
``@setting_ranges`` (``ranges``); see ``registry``.
"""

from __future__ import annotations

from grpo_lightning.losses import cispo, clipped, covariance, gmpo, sapo, vespo  # noqa: F401 (registers them)
from grpo_lightning.losses.aggregation import AGGREGATIONS, STEP_NORMALISED, aggregate
from grpo_lightning.losses.inputs import LossInputs
from grpo_lightning.losses.kl import KL_ESTIMATORS, kl_estimate
from grpo_lightning.losses.objective import grpo_loss
from grpo_lightning.losses.ranges import GENERIC_RANGES, Range, setting_ranges
from grpo_lightning.losses.registry import (
    GENERIC_SETTINGS,
    PolicyLoss,
    SettingOutOfRange,
    available_policy_losses,
    check_policy_loss,
    get_policy_loss,
    register_policy_loss,
)

__all__ = [
    "AGGREGATIONS",
    "GENERIC_RANGES",
    "GENERIC_SETTINGS",
    "KL_ESTIMATORS",
    "STEP_NORMALISED",
    "LossInputs",
    "PolicyLoss",
    "Range",
    "SettingOutOfRange",
    "aggregate",
    "available_policy_losses",
    "check_policy_loss",
    "get_policy_loss",
    "grpo_loss",
    "kl_estimate",
    "register_policy_loss",
    "setting_ranges",
]
