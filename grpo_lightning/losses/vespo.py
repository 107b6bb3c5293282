"""VESPO (as TRL 1.16 implements it): a smooth gamma-shaped weight of the sequence ratio on the log-likelihood.

With the sequence's summed log-ratio log w = Σ_t clip(log ρ_t, −20, 20) (clipped again to [log 1e-8, 20]):

    φ(w) = exp(λ + k log w − λ w) = e^λ · w^k · e^(−λ w)        (φ(1) = 1, no gradient)
    L_t = −φ(w_i) · A_t · log π_θ(y_t)

k, λ by the sign of the advantage: k_pos = 2, λ_pos = 3 for A ≥ 0; k_neg = 3, λ_neg = 2 for A < 0 (TRL's defaults).
φ rises then decays in w, so a completion far off-policy in either direction is weighted down smoothly instead of
clipped. When the sampler is not the trainer, its token weights π_old / π_engine (``LossInputs.is_weights``, the
truncated importance weights) join log w, and the objective does not weight the loss by them again
(``corrects_sampler``). TRL aggregates by the tokens of the step (``token_mean``, the default).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from grpo_lightning.losses.inputs import LossInputs, masked_mean, masked_sum
from grpo_lightning.losses.ranges import Range, setting_ranges
from grpo_lightning.losses.registry import register_policy_loss

_LOG_MIN = math.log(1e-8)
# φ = e^λ w^k e^(−λw) rises from 0 and falls back to 0 only for k > 0 and λ > 0 (a gamma kernel, peak at w = k/λ).
_POWER = Range("(0, inf)", "φ's power w^k weighs down completions far below w = 1 only for k > 0")
_DECAY = Range("(0, inf)", "φ's decay e^(−λw) weighs down completions far above w = 1 only for λ > 0")


@register_policy_loss("vespo", aggregation="token_mean", level="sequence", corrects_sampler=True, source="VESPO")
@setting_ranges(k_pos=_POWER, k_neg=_POWER, lambda_pos=_DECAY, lambda_neg=_DECAY)
def vespo(
    inputs: LossInputs,
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """−φ(w)·A·log π_θ. Metric: ``vespo_weight_mean``, the token mean of φ."""
    mask, adv = inputs.mask, inputs.advantages
    with torch.no_grad():
        log_w = masked_sum(torch.clamp(inputs.log_ratio(), -20.0, 20.0), mask, dim=1).unsqueeze(1)
        if inputs.is_weights is not None:
            log_is = torch.clamp(torch.log(inputs.is_weights), _LOG_MIN, 20.0)
            log_w = log_w + masked_sum(log_is, mask, dim=1).unsqueeze(1)
        log_w = torch.clamp(log_w, _LOG_MIN, 20.0)
        nonneg = adv >= 0
        k = torch.where(nonneg, torch.full_like(adv, k_pos), torch.full_like(adv, k_neg))
        lam = torch.where(nonneg, torch.full_like(adv, lambda_pos), torch.full_like(adv, lambda_neg)).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return -phi * adv * inputs.logprobs, {"vespo_weight_mean": masked_mean(phi, mask)}
