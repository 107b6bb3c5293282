"""Clip-Cov and KL-Cov: the covariance-based losses of Cui et al. 2025 ("The Entropy Mechanism of Reinforcement
Learning for Reasoning Language Models"), as verl defines them (``verl/trainer/ppo/core_algos.py``:
``compute_policy_loss_clip_cov``, ``compute_policy_loss_kl_cov``).

A policy's entropy falls, step after step, by the covariance between a token's log-probability and its
advantage: confident tokens with a high advantage sharpen the policy. Both losses find the tokens of largest
centred product, per token (means over the micro-batch's loss tokens, no gradient):

    Cov_t = (A_t − mean A) · (log π_θ(y_t) − mean log π_θ)

and restrain their update. N is the number of loss tokens of the call, r the loss's ratio setting:

- ``clip_cov``: PPO's surrogate −min(ρA, clip(ρ, 1 − ε_low, 1 + ε_high)A), except that max(⌊r·N⌋, 1) tokens
  (fewer if fewer qualify), drawn at random among those the ratio's clip leaves alone with ``clip_cov_lb`` <
  Cov_t < ``clip_cov_ub``, leave the loss (value and gradient 0). The draw uses ``LossInputs.generator``.
- ``kl_cov``: the unclipped surrogate −ρA, plus ``ppo_kl_coef``·|log ρ| on the max(⌊r·N⌋, 1) tokens of largest
  Cov_t. The penalty and its gradient are 0 at ρ = 1: it acts from a round's second optimizer step on
  (``data.update.num_iterations`` > 1, or several mini-batches), as in verl.

As in verl, the means and N are the micro-batch's (its rows on this rank), so the step depends on the micro-batch
size (``micro_batch_statistics``). Where verl differs in ways that cannot show: its masked means divide by N +
1e-8 (ours by N, a relative 1e-8/N apart), and its KL-Cov breaks ties of Cov_t by ``torch.topk``'s order (ours:
the first token in row order). The selections here make no device sync (ranks, not ``nonzero``/``topk`` of a
data-dependent size).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from grpo_lightning.losses.inputs import LossInputs, masked_mean
from grpo_lightning.losses.ranges import Range, setting_ranges
from grpo_lightning.losses.registry import SettingOutOfRange, register_policy_loss

SOURCE = "Cui et al. 2025, as verl"
RATIO_WHY = "the fraction of the micro-batch's loss tokens it selects (at least one)"


def token_covariance(inputs: LossInputs) -> Tensor:
    """``[B, T]``: Cov_t = (A_t − mean A)(log π_θ(y_t) − mean log π_θ), means over the loss tokens, no gradient
    (anything on padding)."""
    logprobs, adv, mask = inputs.logprobs.detach(), inputs.advantages.detach(), inputs.mask
    return (adv - masked_mean(adv, mask)) * (logprobs - masked_mean(logprobs, mask))


def selection_size(mask: Tensor, ratio: float) -> Tensor:
    """max(⌊ratio · N⌋, 1), N the tokens of ``mask``, as a tensor: verl's ``max(int(ratio * N), 1)`` in float64,
    Python's arithmetic, with no device sync."""
    return torch.floor(mask.sum().to(torch.float64) * ratio).clamp(min=1)


def top_ranked(scores: Tensor, eligible: Tensor, count: Tensor) -> Tensor:
    """The ``count`` eligible tokens of highest score (all of them if fewer; ties: the first in row order)."""
    flat = torch.where(eligible, scores, -math.inf).flatten()
    order = flat.argsort(descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return eligible & (rank.view_as(eligible) < count)


def _bounds_in_order(settings: dict[str, Any]) -> None:
    low, high = settings["clip_cov_lb"], settings["clip_cov_ub"]
    if not low < high:
        raise SettingOutOfRange(
            f"loss_kwargs.clip_cov_lb = {low!r} must be below clip_cov_ub = {high!r} (Clip-Cov draws among the "
            "tokens whose covariance lies between them)"
        )


@register_policy_loss("clip_cov", aggregation="token_mean", source=SOURCE, micro_batch_statistics=True)
@setting_ranges(
    epsilon_low=Range("[0, 1)", "the ratio's lower clip 1 - epsilon_low must stay > 0"),
    epsilon_high=Range("[0, inf)", "the ratio's upper clip 1 + epsilon_high stays >= 1"),
    clip_cov_ratio=Range("(0, 1]", RATIO_WHY),
    clip_cov_lb=Range("[0, inf)", "it detaches tokens of positive covariance, those that lower the entropy"),
    clip_cov_ub=Range("(0, inf]", "an upper bound on the covariance; inf: none"),
)
def clip_cov(
    inputs: LossInputs,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate with a random few high-covariance tokens left out (module docstring). verl's
    defaults: ε 0.2 (``clip_ratio``), ratio 2e-4, bounds 1 and 5.

    Metrics: ``clip_frac_low`` / ``clip_frac_high`` (the ratio's clip, as the clipped losses'), ``cov_selected_frac``
    (the tokens left out: verl's ``pg_clipfrac``).
    """
    ratio, adv, mask = inputs.ratio(), inputs.advantages, inputs.mask
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - epsilon_low, 1 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    cov = token_covariance(inputs)
    candidates = mask & ~(clipped > unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    device = inputs.generator.device if inputs.generator is not None else ratio.device
    keys = torch.rand(mask.shape, generator=inputs.generator, device=device).to(ratio.device)
    selected = top_ranked(keys, candidates, selection_size(mask, clip_cov_ratio))
    per_token = torch.where(selected, torch.zeros_like(per_token), per_token)
    with torch.no_grad():
        metrics = {
            "clip_frac_low": masked_mean(((ratio < 1 - epsilon_low) & (adv < 0)).to(ratio.dtype), mask),
            "clip_frac_high": masked_mean(((ratio > 1 + eps_high) & (adv > 0)).to(ratio.dtype), mask),
            "cov_selected_frac": masked_mean(selected.to(ratio.dtype), mask),
        }
    return per_token, metrics


clip_cov.check_settings = _bounds_in_order  # type: ignore[attr-defined]


@register_policy_loss("kl_cov", aggregation="token_mean", source=SOURCE, micro_batch_statistics=True)
@setting_ranges(
    kl_cov_ratio=Range("(0, 1]", RATIO_WHY),
    ppo_kl_coef=Range("(0, inf)", "the weight of |log ratio| on the selected tokens; 0 leaves them unrestrained"),
)
def kl_cov(
    inputs: LossInputs, *, kl_cov_ratio: float = 2e-4, ppo_kl_coef: float = 0.1
) -> tuple[Tensor, dict[str, Tensor]]:
    """−ρA, plus ``ppo_kl_coef``·|log ρ| on the tokens of largest covariance (module docstring). verl's defaults:
    ratio 2e-4, coefficient 0.1 (its config's; the function's own fallback, 1.0, is never reached from it).

    Metrics: ``cov_selected_frac`` (the penalised tokens), ``abs_log_ratio`` (mean |log ρ|: verl's ``ppo_kl``).
    """
    log_ratio, adv, mask = inputs.log_ratio(), inputs.advantages, inputs.mask
    per_token = -adv * torch.exp(log_ratio)
    selected = top_ranked(token_covariance(inputs), mask, selection_size(mask, kl_cov_ratio))
    per_token = torch.where(selected, per_token + ppo_kl_coef * log_ratio.abs(), per_token)
    with torch.no_grad():
        metrics = {
            "cov_selected_frac": masked_mean(selected.to(per_token.dtype), mask),
            "abs_log_ratio": masked_mean(log_ratio.abs(), mask),
        }
    return per_token, metrics
