"""Advantages as pure tensor functions: how a group's rewards become the weight of each completion (or token).

Notation: a batch holds ``N`` completions, ``G`` per prompt, stored group by group.

``group_advantages`` -- outcome supervision, DeepSeekMath §4.1.2:
    A_i = (r_i - mean(r)) / (std(r) + eps), mean/std over the G rewards of i's group; ``std="population"``
    divides the variance by G, ``std="sample"`` by G - 1 (Bessel's correction, as TRL and verl compute it).
    Variants: baseline "rloo" uses mean of the other G-1 rewards (RLOO, Ahmadian et al. 2024); scale "batch"
    uses the std of all rewards of the batch; scale "none" drops the std (Dr. GRPO, Liu et al. 2025).

``process_advantages`` -- process supervision, DeepSeekMath §4.1.3:
    r~_i^j = (r_i^j - mean(R)) / (std(R) + eps), R = every step reward of the group;
    A_{i,t} = sum over steps j with end(j) >= t of r~_i^j.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["group_advantages", "process_advantages"]

_SCALES = ("group", "batch", "none")
_BASELINES = ("mean", "rloo")
_STDS = ("population", "sample")


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _check_groups(n: int, group_size: int) -> None:
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (a group of one has no baseline), got {group_size}")
    if n % group_size != 0:
        raise ValueError(f"number of completions ({n}) is not divisible by group_size ({group_size})")


def group_advantages(
    rewards: Tensor,
    group_size: int,
    *,
    scale: str = "group",
    baseline: str = "mean",
    eps: float = 1e-4,
    batch_std: Tensor | None = None,
    std: str = "population",
    scorable: Tensor | None = None,
) -> Tensor:
    """Outcome-reward advantages, one per completion.

    Args:
        rewards: ``[N]`` rewards ordered group by group (``N = prompts * group_size``).
        group_size: completions per prompt ``G`` (>= 2).
        scale: ``"group"`` (std of the group), ``"batch"`` (std of all N rewards) or ``"none"``.
        baseline: ``"mean"`` (group mean, GRPO) or ``"rloo"`` (mean of the other G-1 rewards).
        eps: added to the std before dividing.
        batch_std: with ``scale="batch"``, a std computed by the caller (e.g. across ranks) that replaces
            the local one.
        std: ``"population"`` (divide the variance by the count) or ``"sample"`` (by the count - 1).
        scorable: ``[N]`` bool, False where no reward applied (every reward function returned None): such a
            completion is left out of its group's mean, std and RLOO baseline, and gets advantage 0 (as TRL does);
            None: all are.

    Returns:
        ``[N]`` advantages; every group whose rewards are all equal gets exactly 0.
    """
    _check_choice("scale", scale, _SCALES)
    _check_choice("baseline", baseline, _BASELINES)
    _check_choice("std", std, _STDS)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    _check_groups(rewards.numel(), group_size)
    if batch_std is not None and scale != "batch":
        raise ValueError(f"batch_std is only used with scale='batch', got scale={scale!r}")

    r = rewards.float() if not rewards.is_floating_point() else rewards
    if scorable is not None and not bool(scorable.all()):
        return _masked_group_advantages(r, scorable, group_size, scale, baseline, eps, batch_std, std == "sample")
    groups = r.reshape(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    if baseline == "mean":
        adv = groups - mean
    else:
        # Mean of the others: (sum - r_i) / (G - 1), which simplifies to G/(G-1) * (r_i - mean).
        adv = (groups - mean) * (group_size / (group_size - 1))

    unbiased = std == "sample"
    if scale == "group":
        adv = adv / (groups.std(dim=1, unbiased=unbiased, keepdim=True) + eps)
    elif scale == "batch":
        adv = adv / ((batch_std if batch_std is not None else r.std(unbiased=unbiased)) + eps)

    # r_i - mean can be off by one ulp when all rewards are equal; force the documented exact zero.
    same = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)
    return torch.where(same, torch.zeros_like(adv), adv).reshape(-1)


def _masked_group_advantages(
    r: Tensor,
    scorable: Tensor,
    group_size: int,
    scale: str,
    baseline: str,
    eps: float,
    batch_std: Tensor | None,
    unbiased: bool,
) -> Tensor:
    """``group_advantages`` over the scorable completions of each group only; the others get 0."""
    valid = scorable.reshape(-1, group_size).to(r.device)
    groups = r.reshape(-1, group_size)
    count = valid.sum(dim=1, keepdim=True)
    mean = torch.where(valid, groups, 0.0).sum(dim=1, keepdim=True) / count.clamp(min=1)
    adv = groups - mean
    if baseline == "rloo":  # mean of the other scorable ones: n / (n - 1) × (r - mean); 0 for a lone one
        adv = torch.where(count > 1, adv * count / (count - 1).clamp(min=1), torch.zeros_like(adv))
    squares = torch.where(valid, (groups - mean) ** 2, 0.0)
    if scale == "group":
        adv = adv / ((squares.sum(dim=1, keepdim=True) / (count - int(unbiased)).clamp(min=1)).sqrt() + eps)
    elif scale == "batch":
        local = r[scorable.to(r.device)]
        adv = adv / ((batch_std if batch_std is not None else local.std(unbiased=unbiased)) + eps)
    low = torch.where(valid, groups, torch.inf).amin(dim=1, keepdim=True)
    high = torch.where(valid, groups, -torch.inf).amax(dim=1, keepdim=True)
    return torch.where(valid & (high > low), adv, torch.zeros_like(adv)).reshape(-1)


def process_advantages(
    step_rewards: Tensor,
    step_ends: Tensor,
    mask: Tensor,
    group_size: int,
    *,
    eps: float = 1e-4,
    std: str = "population",
) -> Tensor:
    """Per-token advantages from per-step (process) rewards.

    Layout: completion ``b`` has up to ``S`` reasoning steps. ``step_rewards[b, s]`` is the reward of its
    ``s``-th step, NaN when the completion has fewer steps (padding). ``step_ends[b, s]`` is the index, in
    completion coordinates ``0..T-1``, of the last token of that step (ignored for NaN steps).

    Args:
        step_rewards: ``[B, S]`` float, NaN for missing steps.
        step_ends: ``[B, S]`` integer token index where each step ends (inclusive).
        mask: ``[B, T]`` completion mask (bool or 0/1).
        group_size: completions per prompt ``G``; rows are ordered group by group.
        eps: added to the group std before dividing.
        std: ``"population"`` or ``"sample"`` std of the group's step rewards (see ``group_advantages``).

    Returns:
        ``[B, T]`` advantages: for token ``t``, the sum of the normalised rewards of the steps ending at or
        after ``t``; 0 on masked tokens. A group whose step rewards are all equal (or absent) gets 0.
    """
    if step_rewards.dim() != 2 or step_ends.shape != step_rewards.shape:
        raise ValueError(
            f"step_rewards and step_ends must both be [B, S], got {tuple(step_rewards.shape)} "
            f"and {tuple(step_ends.shape)}"
        )
    if mask.dim() != 2 or mask.shape[0] != step_rewards.shape[0]:
        raise ValueError(f"mask must be [B, T] with B={step_rewards.shape[0]}, got {tuple(mask.shape)}")
    _check_groups(step_rewards.shape[0], group_size)
    _check_choice("std", std, _STDS)

    B, S = step_rewards.shape
    # Pool every valid step of a group into one row: [B, S] -> [groups, G * S].
    valid = ~torch.isnan(step_rewards).reshape(-1, group_size * S)
    r = step_rewards.reshape(-1, group_size * S)
    zero = torch.zeros_like(r)
    count = valid.sum(dim=1, keepdim=True).clamp(min=1)
    mean = torch.where(valid, r, zero).sum(dim=1, keepdim=True) / count
    dof = count if std == "population" else (count - 1).clamp(min=1)
    var = torch.where(valid, (r - mean) ** 2, zero).sum(dim=1, keepdim=True) / dof
    normed = (r - mean) / (var.sqrt() + eps)
    # Equal rewards would give tiny rounding residues instead of 0; zero them explicitly (and NaN padding).
    hi = torch.where(valid, r, -torch.inf).amax(dim=1, keepdim=True)
    lo = torch.where(valid, r, torch.inf).amin(dim=1, keepdim=True)
    normed = torch.where(valid & (hi != lo), normed, zero).view(B, S)

    # covers[b, s, t] = step s of row b ends at or after token t.
    positions = torch.arange(mask.shape[1], device=mask.device)
    covers = (step_ends.unsqueeze(-1) >= positions).to(normed.dtype)
    adv = torch.einsum("bs,bst->bt", normed, covers)
    return torch.where(mask.bool(), adv, torch.zeros_like(adv))
