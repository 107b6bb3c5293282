"""CISPO (MiniMax-M1, 2025): clip the importance weight, not the update; every token keeps its gradient.

    L_t = −sg(r̂_t) · A_t · log π_θ(y_t),   r̂_t = clip(ρ_t, 1 − ε_low, 1 + ε_high)

as the paper writes it (its ε^IS_low, ε^IS_high): a relative, two-sided clip of the weight, which is stopped from
the gradient, so a clipped token still contributes A·∇log π (scaled by its capped weight) instead of nothing as in
PPO's clip. The paper sets no lower bound ("ε^IS_low large") and tunes ε_high only. Our defaults:
``epsilon_low: 1.0`` (lower bound 0, i.e. none) and ``epsilon_high: 4.0``, a cap of 5.0 on the weight (ScaleRL's).

Mapping to the peers:
- TRL 1.16 (``loss_type="cispo"``) caps with an absolute bound, clamp(ρ, max=epsilon_high) and no lower bound: TRL's
  ``epsilon_high: C`` is ours ``epsilon_low: 1.0, epsilon_high: C − 1`` (ScaleRL's C = 5.0 → 4.0). TRL's default
  leaves ``epsilon_high`` equal to ``epsilon`` = 0.2, a cap of 0.2 on every weight; ours do not.
- verl (``policy_loss.loss_mode: cispo``) clips relatively on both sides: its ``clip_ratio_low``/``clip_ratio_high``
  are ours ``epsilon_low``/``epsilon_high`` as they are.

The paper normalises by the tokens of the batch (``token_mean``, the default); other aggregations are allowed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_lightning.losses.inputs import LossInputs, masked_mean
from grpo_lightning.losses.ranges import Range, setting_ranges
from grpo_lightning.losses.registry import register_policy_loss


@register_policy_loss("cispo", aggregation="token_mean", source="MiniMax-M1")
@setting_ranges(
    epsilon_low=Range("[0, 1]", "the weight's lower bound 1 - epsilon_low, none at 1 as in the paper"),
    epsilon_high=Range("[0, inf)", "the weight's cap 1 + epsilon_high stays >= 1; TRL's absolute cap C is C - 1"),
)
def cispo(
    inputs: LossInputs,
    *,
    epsilon_low: float = 1.0,
    epsilon_high: float | None = 4.0,
    importance_sampling_level: str = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """−sg(clip(ρ, 1 − ε_low, 1 + ε_high))·A·log π_θ. Metrics: ``clip_frac_low``/``clip_frac_high``, the tokens
    whose weight was clipped from below/above."""
    ratio = inputs.ratio(importance_sampling_level).detach()
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    weight = torch.clamp(ratio, 1 - epsilon_low, 1 + eps_high)
    per_token = -weight * inputs.advantages * inputs.logprobs
    metrics = {
        "clip_frac_low": masked_mean((ratio < 1 - epsilon_low).to(ratio.dtype), inputs.mask),
        "clip_frac_high": masked_mean((ratio > 1 + eps_high).to(ratio.dtype), inputs.mask),
    }
    return per_token, metrics
