"""Per-token KL(π_θ ‖ π_ref) estimators on sampled tokens, and their importance-weighted form.

With d = log π_ref − log π_θ (Schulman, "Approximating KL divergence"; k3 is DeepSeekMath's):
k1 = −d, k2 = d² / 2, k3 = exp(d) − d − 1. At a context s, each estimates KL(π_θ(·|s) ‖ π_ref(·|s)) only on a
token drawn from π_θ; ours were drawn by a sampler μ: π_old when the trainer sampled at lag 0, else an older policy
(``data.schedule.rollout_lag``) or another engine's kernels (vLLM). ``kl_importance_weighted`` weights each token's
estimator by the whole way from the sampler,

    π_θ / μ = (π_θ / π_old) · (π_old / μ) = ρ · w,

ρ differentiable, w the behaviour weight the policy term gets (``LossInputs.is_weights``: the same truncation or
mask, cap and level, no gradient). E_π_θ[k] is KL(π_θ ‖ π_ref) for k1 and k3 (k2 is Schulman's biased,
low-variance one). What the token-level weighting's expectation is, at each sampled context (the contexts are the
sampler's, as for the policy term's token ratio), by the sampler and ``tis_cap``:

- μ = π_old (the trainer sampled: no ``engine_logprobs``, no w): E_μ[ρ·k] = E_π_θ[k], unbiased (the
  bias-corrected KL of DeepSeek-V3.2, TRL's ``use_bias_correction_kl``);
- μ ≠ π_old, weights untruncated (a cap no weight reaches): E_μ[ρ·w·k] = E_π_θ[k], unbiased;
- μ ≠ π_old, w truncated at C: Σ_y π_θ(y)·min(1, C·μ(y)/π_old(y))·k(y), the tokens μ under-samples by more than a
  factor C counted less (masked outside [1/C, C]: left out), biased low there as the policy term is;
- μ ≠ π_old with ``tis_cap: null`` (w = 1, the policy term uncorrected too) or ``off_policy_correction: none``:
  E_μ[ρ·k] = Σ_y μ(y)·π_θ(y)/π_old(y)·k(y), π_θ's KL reweighted by μ/π_old, not KL(π_θ ‖ π_ref).

At sequence level (a loss on GSPO's ratio, or ``importance_sampling_level: sequence``) ρ is s_i = exp(mean_t
log ρ_t) on every token of the completion, with the gradient of each of its tokens (as TRL computes it): GSPO's
length-normalised proxy of a token's importance weight (its own ratio ρ_t is the exact one), so the expectations
above hold where s_i = ρ_t (a one-token completion), w as given (per token or per sequence, ``tis_level``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_lightning.losses.inputs import LossInputs

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: str = "k3") -> Tensor:
    """``[B, T]`` per-token estimate of KL(π_θ ‖ π_ref) (for tokens drawn from π_θ), 0 on padding."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    d = torch.where(mask, ref_logprobs - logprobs, torch.zeros_like(logprobs))
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return d.pow(2) / 2
    return torch.exp(d) - d - 1


def importance_weighted_kl(kl: Tensor, inputs: LossInputs, level: str = "token") -> Tensor:
    """``kl`` times π_θ / μ: the ratio π_θ / π_old at ``level`` (``token`` ρ_t, ``sequence`` s_i; with gradient)
    times the behaviour weights π_old / μ when another sampler drew the tokens (``inputs.is_weights``)."""
    log_ratio = inputs.sequence_log_ratio().unsqueeze(1) if level == "sequence" else inputs.log_ratio()
    weighted = kl * torch.exp(log_ratio)
    return weighted if inputs.is_weights is None else weighted * inputs.is_weights
