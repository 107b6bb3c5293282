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

``decoupled_sum`` then ``batch_normalized`` -- GDPO (Liu et al. 2026, NVIDIA), several rewards r^1..r^K with
weights w_k, TRL 1.16's ``multi_objective_aggregation="normalize_then_sum"``:
    A_sum_i = sum_k w_k (r^k_i - mean(r^k)) / (std(r^k) + eps), each reward normalised within i's group;
    A_i = (A_sum_i - mean(A_sum)) / (std(A_sum) + eps), mean/std over the whole batch (all ranks).

``passk_advantages`` -- verl's ``grpo_passk`` (Tang et al. 2025), training for the best of k completions:
    A_i = 1/C(n, k) * sum over the k-subsets S of the group that hold i of [max(S) - max(S without i)]:
    in every set of k attempts only the best one gains, by how much it beats the best of the others.
    At k = n = G it is verl's: r_max - r_second_max for the group's best, 0 for the others.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["batch_normalized", "decoupled_sum", "group_advantages", "passk_advantages", "process_advantages"]

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


def _masked_stats(x: Tensor, valid: Tensor, unbiased: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Mean and std of the ``valid`` entries of ``x`` along dim 1 (kept), and whether they are not all equal.

    A lone entry, or none, has std 0 (TRL's ``nanstd`` gives NaN there; either way the group has nothing to
    compare, and every caller gives it 0)."""
    zero = torch.zeros_like(x)
    count = valid.sum(dim=1, keepdim=True)
    mean = torch.where(valid, x, zero).sum(dim=1, keepdim=True) / count.clamp(min=1)
    squares = torch.where(valid, (x - mean) ** 2, zero).sum(dim=1, keepdim=True)
    std = (squares / (count - int(unbiased)).clamp(min=1)).sqrt()
    high = torch.where(valid, x, -torch.inf).amax(dim=1, keepdim=True)
    low = torch.where(valid, x, torch.inf).amin(dim=1, keepdim=True)
    return mean, std, high > low


def decoupled_sum(
    rewards: Tensor, weights: Tensor, group_size: int, *, eps: float = 1e-4, std: str = "population"
) -> Tensor:
    """GDPO's first step: every reward normalised within its group on its own, then their weighted sum.

    Args:
        rewards: ``[N, K]`` the K rewards of each completion (ordered group by group), NaN where a reward does
            not apply (its function returned None).
        weights: ``[K]`` the rewards' weights (``data.rewards[].weight``).
        group_size: completions per prompt ``G`` (>= 2).
        eps: added to each reward's group std.
        std: ``"population"`` or ``"sample"`` (TRL's), as in ``group_advantages``.

    Returns:
        ``[N]`` A_sum_i = sum_k w_k (r^k_i - mean) / (std + eps), the mean and std of r^k over the completions of
        i's group it applies to; a reward that does not apply to i adds nothing, and one that is constant in the
        group (or applies to one completion only) adds exactly 0. NaN where no reward applies (unscorable).
    """
    _check_choice("std", std, _STDS)
    if rewards.dim() != 2 or tuple(weights.shape) != (rewards.shape[1],):
        raise ValueError(
            f"rewards must be [N, K] and weights [K], got {tuple(rewards.shape)} and {tuple(weights.shape)}"
        )
    _check_groups(rewards.shape[0], group_size)
    r = rewards if rewards.is_floating_point() else rewards.float()
    grouped = r.reshape(-1, group_size, r.shape[1])  # [prompts, G, K]: one column per reward
    applies = ~grouped.isnan()
    mean, sd, spread = _masked_stats(grouped, applies, std == "sample")
    normalised = torch.where(applies & spread, (grouped - mean) / (sd + eps), torch.zeros_like(grouped))
    summed = (normalised * weights.to(normalised)).sum(dim=-1).reshape(-1)
    return torch.where(applies.any(dim=-1).reshape(-1), summed, torch.nan)


def batch_normalized(
    summed: Tensor, *, eps: float = 1e-4, std: str = "population", batch: Tensor | None = None
) -> Tensor:
    """GDPO's second step: A_i = (A_sum_i - mean) / (std + eps), the mean and std of the whole batch's sums, so that
    the advantages' range does not grow with the number of rewards.

    Args:
        summed: ``[N]`` ``decoupled_sum``'s values, NaN for unscorable completions.
        eps: added to the batch std.
        std: ``"population"`` or ``"sample"`` (TRL's).
        batch: every rank's ``summed``, gathered by the caller: the batch the mean and std are taken over;
            None: ``summed``.

    Returns:
        ``[N]`` advantages: 0 for unscorable completions (out of the mean and std too) and where the sum is 0.
    """
    _check_choice("std", std, _STDS)
    values = (summed if batch is None else batch).reshape(-1)
    scored = values[~values.isnan()]
    if scored.numel() == 0:
        return torch.zeros_like(summed)
    spread = scored.std(unbiased=std == "sample") if scored.numel() > 1 else scored.new_zeros(())
    adv = (summed - scored.mean()) / (spread + eps)
    # The batch mean is 0 in exact arithmetic (each reward's normalised values sum to 0 within their group), so a
    # sum of 0 -- every reward constant in the group -- has advantage exactly 0; subtracting the computed mean, as
    # the paper and TRL write it, would leave a rounding residue there.
    return torch.where(summed.isnan() | (summed == 0), torch.zeros_like(adv), adv)


def _log_binomial(n: Tensor, k: Tensor) -> Tensor:
    """log C(n, k) for 0 <= k <= n (float64); -inf elsewhere, so that exp gives C = 0."""
    n, k = n.double(), k.double()
    inside = (k >= 0) & (k <= n)
    n, k = torch.where(inside, n, 0.0), torch.where(inside, k, 0.0)
    value = torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)
    return torch.where(inside, value, -torch.inf)


def passk_advantages(
    rewards: Tensor,
    group_size: int,
    k: int | None = None,
    *,
    scale: str = "group",
    eps: float = 1e-4,
    std: str = "population",
    batch_std: Tensor | None = None,
    scorable: Tensor | None = None,
) -> Tensor:
    """Pass@k advantages (verl's ``grpo_passk``, Tang et al. 2025), one per completion.

    Each k-subset S of a group is one pass@k attempt: only its best completion gains, max(S) - max(S without it).
    Averaged over the C(n, k) subsets, with the group's n completions ranked best first (ties in any order: tied
    completions get the same value), completion p gets

        A_p = sum over q ranked below p of C(n - q, k - 2) / C(n, k) * (r_p - r_q)

    (the subsets whose best is p and second best q: the other k - 2 members come from the n - q below q).
    At k = n only the best completion gains, r_max - r_second_max: verl's ``grpo_passk``, which has no k.

    Args:
        rewards: ``[N]`` rewards ordered group by group.
        group_size: completions per prompt ``G`` (>= 2).
        k: the attempts pass@k counts, 2 <= k <= G; None: G.
        scale: ``"group"`` divides by the std of the group's rewards (verl's ``norm_adv_by_std_in_grpo``),
            ``"batch"`` by the std of all N, ``"none"`` by nothing.
        eps, std, batch_std: as in ``group_advantages``.
        scorable: ``[N]`` bool, False where no reward applied: such a completion is left out of its group (n
            counts the others; a group with fewer than k of them takes them all as its attempt) and gets 0.

    Returns:
        ``[N]`` advantages, all >= 0; every group whose rewards are all equal gets exactly 0.
    """
    _check_choice("scale", scale, _SCALES)
    _check_choice("std", std, _STDS)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    _check_groups(rewards.numel(), group_size)
    k = group_size if k is None else k
    if not 2 <= k <= group_size:
        raise ValueError(f"k must be between 2 and group_size={group_size}, got {k}")
    if batch_std is not None and scale != "batch":
        raise ValueError(f"batch_std is only used with scale='batch', got scale={scale!r}")

    r = rewards.float() if not rewards.is_floating_point() else rewards
    groups = r.reshape(-1, group_size)
    valid = torch.ones_like(groups, dtype=torch.bool) if scorable is None else scorable.reshape(-1, group_size)
    valid = valid.to(r.device)
    n = valid.sum(dim=1, keepdim=True)  # [prompts, 1] completions that count
    attempts = n.clamp(max=k)
    ranked, order = torch.where(valid, groups, -torch.inf).sort(dim=1, descending=True, stable=True)
    position = torch.arange(1, group_size + 1, device=r.device)  # rank q = 1..G, best first
    counted = position <= n  # [prompts, G] the first n ranks are the completions that count
    ranked = torch.where(counted, ranked, 0.0).double()
    # c_q = C(n - q, k - 2) / C(n, k), in log space (C(64, 32) ~ 1.8e18); 0 where q > n or too few are below q.
    c = torch.exp(_log_binomial(n - position, attempts - 2) - _log_binomial(n, attempts))
    c = torch.where(counted, c, 0.0)
    below = position[None, :] > position[:, None]  # [p, q]: q ranked below p
    pairs = (ranked[:, :, None] - ranked[:, None, :]) * c[:, None, :]  # [prompts, p, q]
    ranked_adv = torch.where(below, pairs, 0.0).sum(dim=-1)
    adv = torch.zeros_like(ranked_adv).scatter(1, order, torch.where(counted, ranked_adv, 0.0)).to(r.dtype)

    unbiased = std == "sample"
    if scale == "group":
        adv = adv / (_masked_stats(groups, valid, unbiased)[1] + eps)
    elif scale == "batch":
        adv = adv / ((batch_std if batch_std is not None else r[valid.reshape(-1)].std(unbiased=unbiased)) + eps)
    return adv.reshape(-1)


def distillation_advantages(gap: Tensor, mask: Tensor, weight: float) -> Tensor:
    """``[N, T]`` per-token advantages λ · (log π_T − log π_S) of the sampled tokens (``gap``), 0 outside ``mask``:
    on-policy distillation's (``model.teacher``, ``grpo_lightning/distillation.py``)."""
    return weight * gap * mask
