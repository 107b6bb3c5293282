"""GMPO (Geometric-Mean Policy Optimization, Zhao et al. 2025): the geometric mean of the token ratios.

Per completion, with ℓ_t = log ρ_t and the advantage's sign σ = sign(A):

    ℓ̂_t = σ · min(σ ℓ_t, σ clip(ℓ_t, −ε_low, ε_high))       (the clip in log space, sign-aware like PPO's)
    L_i = −A · exp((1/|o_i|) Σ_t ℓ̂_t)

so for A > 0 a token's log-ratio counts at most ε_high, for A < 0 at least −ε_low, and a token past the bound
gives no gradient. The geometric mean is far less sensitive to one outlying token than GRPO's arithmetic mean of
token ratios, which lets the paper widen the clip to (e^−0.4, e^0.4): ``epsilon_low = epsilon_high = 0.4`` here,
in log space (the same meaning as verl's ``clip_ratio_low/high`` for its ``gmpo`` mode). The objective is a mean
over completions of L_i (``sequence_mean``, fixed). With per-token advantages A is the completion's mean.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_lightning.losses.inputs import LossInputs, masked_mean, sequence_mean
from grpo_lightning.losses.ranges import Range, setting_ranges
from grpo_lightning.losses.registry import register_policy_loss


@register_policy_loss("gmpo", aggregation="sequence_mean", fixed=True, level="sequence", source="GMPO")
@setting_ranges(
    epsilon_low=Range("[0, inf)", "in log space: a token's log-ratio counts at least -epsilon_low"),
    epsilon_high=Range("[0, inf)", "in log space: a token's log-ratio counts at most epsilon_high"),
)
def gmpo(
    inputs: LossInputs, *, epsilon_low: float = 0.4, epsilon_high: float | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """−A·exp(mean of the sign-aware, log-space-clipped log-ratios), on every token of the completion.

    Metrics: ``clip_frac_low`` (ℓ < −ε_low with A < 0) and ``clip_frac_high`` (ℓ > ε_high with A > 0).
    """
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    mask = inputs.mask
    log_ratio = inputs.log_ratio()
    adv = sequence_mean(inputs.advantages, mask).unsqueeze(1)
    sign = torch.sign(adv)
    clipped = torch.clamp(log_ratio, -epsilon_low, eps_high)
    bounded = sign * torch.min(sign * log_ratio, sign * clipped)
    geometric = torch.exp(sequence_mean(bounded, mask)).unsqueeze(1)
    per_token = (-adv * geometric).expand_as(log_ratio)
    with torch.no_grad():
        metrics = {
            "clip_frac_low": masked_mean(((log_ratio < -epsilon_low) & (adv < 0)).to(adv.dtype), mask),
            "clip_frac_high": masked_mean(((log_ratio > eps_high) & (adv > 0)).to(adv.dtype), mask),
        }
    return per_token, metrics
