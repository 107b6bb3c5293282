"""Per-token KL(π_θ ‖ π_ref) estimators on tokens sampled from π_old, and their importance-weighted form.

With d = log π_ref − log π_θ (Schulman, "Approximating KL divergence"; k3 is DeepSeekMath's):
k1 = −d, k2 = d² / 2, k3 = exp(d) − d − 1. The tokens were drawn from π_old, not π_θ, so the unbiased estimate of
KL(π_θ ‖ π_ref) weights each token's estimator by ρ = π_θ / π_old (the "unbiased" or bias-corrected KL of
DeepSeek-V3.2, TRL's ``use_bias_correction_kl``), with its gradient: the token ratio, or at sequence level GSPO's
s_i = exp(mean_t log ρ_t) with the gradient of every token of the completion (as TRL computes it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_lightning.losses.inputs import LossInputs

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: str = "k3") -> Tensor:
    """``[B, T]`` per-token estimate of KL(π_θ ‖ π_ref), 0 on padding."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    d = torch.where(mask, ref_logprobs - logprobs, torch.zeros_like(logprobs))
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return d.pow(2) / 2
    return torch.exp(d) - d - 1


def importance_weighted_kl(kl: Tensor, inputs: LossInputs, level: str = "token") -> Tensor:
    """``kl`` times the (differentiable) ratio π_θ / π_old at ``level``: ``token`` ρ_t, ``sequence`` s_i."""
    if level == "sequence":
        return kl * torch.exp(inputs.sequence_log_ratio()).unsqueeze(1)
    return kl * torch.exp(inputs.log_ratio())
