"""The PPO clipped surrogate of GRPO and its descendants: ``grpo``, ``dapo``, ``dr_grpo``, ``bnpo``, ``luspo``.

DeepSeekMath §4.1.1 (the GRPO objective, negated, per token):

    L_t = −min(ρ_t A_t, clip(ρ_t, 1 − ε_low, 1 + ε_high) A_t)

- ε_high > ε_low is DAPO's clip-higher (Yu et al. 2025).
- ``delta``: ρ ← min(ρ, δ) in the unclipped branch, the two-sided clipping of INTELLECT-2 (TRL's ``delta``).
- ``clip_ratio_c``: the dual clip of Ye et al. 2020 (verl's ``clip_ratio_c``, 3.0 there): for A < 0 the loss is
  further bounded by c·|A|, so that one token with a huge ratio cannot dominate a negative update.
- ``importance_sampling_level: sequence`` uses GSPO's s_i (``LossInputs.ratio``; GSPO, Zheng et al. 2025).

The four GRPO-family names are this one loss with the aggregation their papers define (``aggregation.py``):
``grpo`` sequence_mean, ``dapo`` token_mean, ``dr_grpo`` constant, ``bnpo`` micro_batch_token_mean. ``luspo``
(Length-Unbiased Sequence Policy Optimization, as TRL 1.16 implements it) is the GSPO surrogate with each
completion's loss weighted by its length: the sum over its tokens (``sequence_sum``), at sequence level.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_lightning.losses.inputs import LossInputs, masked_mean
from grpo_lightning.losses.ranges import Range, setting_ranges
from grpo_lightning.losses.registry import register_policy_loss

# PPO's clip bounds the ratio to [1 − ε_low, 1 + ε_high], so ε_low < 1; INTELLECT-2's δ and the dual clip's c (Ye
# et al. 2020) bound it further from above, past ratio 1: at or below it they would cut the on-policy gradient.
clip_ranges = setting_ranges(
    epsilon_low=Range("[0, 1)", "the ratio's lower clip 1 - epsilon_low must stay > 0"),
    epsilon_high=Range("[0, inf)", "the ratio's upper clip 1 + epsilon_high stays >= 1"),
    delta=Range("(1, inf)", "it caps the ratio from above; at or below 1 it cuts the on-policy gradient"),
    clip_ratio_c=Range("(1, inf)", "the dual clip bounds a negative advantage's loss by c·|A|, |A| on-policy"),
)


@register_policy_loss("grpo", aggregation="sequence_mean", fixed=True, source="DeepSeekMath")
@register_policy_loss("dapo", aggregation="token_mean", fixed=True, source="DAPO §3.3")
@register_policy_loss("dr_grpo", aggregation="constant", fixed=True, source="Dr. GRPO")
@register_policy_loss("bnpo", aggregation="micro_batch_token_mean", fixed=True, source="BNPO")
@clip_ranges
def clipped_surrogate(
    inputs: LossInputs,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    clip_ratio_c: float | None = None,
    importance_sampling_level: str = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """−min(ρA, clip(ρ, 1 − ε_low, 1 + ε_high)A), with optional δ cap and dual clip (module docstring).

    Metrics: ``clip_frac_low`` (ρ < 1 − ε_low with A < 0), ``clip_frac_high`` (ρ > 1 + ε_high with A > 0) and,
    with ``clip_ratio_c``, ``clip_frac_dual`` (tokens whose loss the dual clip bounded).
    """
    ratio = inputs.ratio(importance_sampling_level)
    adv, mask = inputs.advantages, inputs.mask
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + eps_high)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    per_token = -torch.min(unclipped * adv, clipped * adv)
    with torch.no_grad():
        metrics = {
            "clip_frac_low": masked_mean(((ratio < 1 - epsilon_low) & (adv < 0)).to(ratio.dtype), mask),
            "clip_frac_high": masked_mean(((ratio > 1 + eps_high) & (adv > 0)).to(ratio.dtype), mask),
        }
    if clip_ratio_c is not None:
        bound = -clip_ratio_c * adv  # c·|A| where A < 0
        dual = (adv < 0) & (per_token > bound)
        per_token = torch.where(adv < 0, torch.min(per_token, bound), per_token)
        metrics["clip_frac_dual"] = masked_mean(dual.detach().to(ratio.dtype), mask)
    return per_token, metrics


@register_policy_loss(
    "luspo", aggregation="sequence_sum", fixed=True, level="sequence", source="LUSPO: length-weighted sequences"
)
@clip_ranges
def luspo(
    inputs: LossInputs,
    *,
    epsilon_low: float = 2e-3,
    epsilon_high: float | None = 2.5e-3,
    delta: float | None = None,
    clip_ratio_c: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO's clipped surrogate on s_i (defaults: the LUSPO paper's ε 2e-3 / 2.5e-3); the length weighting is
    its fixed ``sequence_sum`` aggregation."""
    return clipped_surrogate(
        inputs,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        delta=delta,
        clip_ratio_c=clip_ratio_c,
        importance_sampling_level="sequence",
    )
