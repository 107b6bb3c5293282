"""SAPO (Soft Adaptive Policy Optimization, Gao et al. 2025): a smooth gate in place of the hard clip.

    L_t = −f(ρ_t) · A_t,   f(ρ) = σ(τ (ρ − 1)) · 4 / τ,   τ = τ_pos if A_t > 0 else τ_neg

f(1) = 2/τ and f'(1) = 1: on-policy the gradient is the policy gradient; away from ρ = 1 the gate's gradient,
f'(ρ) = 4 σ(1 − σ), decays smoothly instead of dropping to 0 at a clip edge. τ_neg > τ_pos makes the decay
faster for negative advantages (the paper's argument: negative updates spread mass over many tokens and are the
less stable). Defaults τ_pos = 1.0, τ_neg = 1.05: the paper's, TRL's and verl's. Token ratio by default, GSPO's s_i
with ``importance_sampling_level: sequence``. The paper averages each completion's tokens, then the completions
(``sequence_mean``, the default); other aggregations are allowed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_lightning.losses.inputs import LossInputs
from grpo_lightning.losses.ranges import Range, setting_ranges
from grpo_lightning.losses.registry import register_policy_loss

_TEMPERATURE = Range("(0, inf)", "the gate's temperature: σ(τ(ρ − 1))·4/τ divides by it; SAPO's τ > 0")


@register_policy_loss("sapo", aggregation="sequence_mean", source="SAPO")
@setting_ranges(tau_pos=_TEMPERATURE, tau_neg=_TEMPERATURE)
def sapo(
    inputs: LossInputs, *, tau_pos: float = 1.0, tau_neg: float = 1.05, importance_sampling_level: str = "token"
) -> tuple[Tensor, dict[str, Tensor]]:
    """−σ(τ(ρ − 1))·4/τ·A, τ by the sign of A."""
    ratio = inputs.ratio(importance_sampling_level)
    adv = inputs.advantages
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    return -gate * adv, {}
