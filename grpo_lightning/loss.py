"""GRPO-family losses and advantages as pure tensor functions.

Notation: a batch holds ``B`` completions, ``G`` per prompt, stored group by group; ``T`` is the padded
completion length and ``mask`` marks real completion tokens. Each function maps to:

``group_advantages`` -- outcome supervision, DeepSeekMath §4.1.2:
    A_i = (r_i - mean(r)) / (std(r) + eps), mean/std over the G rewards of i's group; ``std="population"``
    divides the variance by G, ``std="sample"`` by G - 1 (Bessel's correction, as TRL and verl compute it).
    Variants: baseline "rloo" uses mean of the other G-1 rewards (RLOO, Ahmadian et al. 2024); scale "batch"
    uses the std of all rewards of the batch; scale "none" drops the std (Dr. GRPO, Liu et al. 2025).

``process_advantages`` -- process supervision, DeepSeekMath §4.1.3:
    r~_i^j = (r_i^j - mean(R)) / (std(R) + eps), R = every step reward of the group;
    A_{i,t} = sum over steps j with end(j) >= t of r~_i^j.

``grpo_loss`` -- clipped surrogate with KL penalty, DeepSeekMath §4.1.1 (GRPO objective, negated):
    L_{i,t} = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) + beta * KL_{i,t} - c * H_{i,t}
    rho_{i,t} = pi(y_t) / pi_old(y_t)                              (token level)
    rho_i     = exp(mean_t log(pi(y_t) / pi_old(y_t)))             (sequence level, GSPO, Zheng et al. 2025)
    Sequence level is computed in the GSPO-token form rho_{i,t} = sg[rho_i] * pi(y_t) / sg[pi(y_t)]: the same
    value and, with one advantage per completion, the same gradient as GSPO; with per-token (process)
    advantages it is GSPO-token (Zheng et al. 2025, §4.3), where each token's gradient carries its own A_{i,t}.
    eps_high != eps_low is DAPO's "clip-higher"; rho <- min(rho, delta) in the unclipped branch is the
    two-sided clipping of INTELLECT-2. KL estimators with d = log pi_ref - log pi (Schulman, "Approximating
    KL divergence"; k3 is DeepSeekMath's): k1 = -d, k2 = d^2 / 2, k3 = exp(d) - d - 1.
    Aggregation of L_{i,t} over tokens:
      "grpo"    (1/B) sum_i (1/|o_i|) sum_t L_{i,t}               (DeepSeekMath; an empty row counts as 0)
      "dapo"    (1/num_items) sum_{i,t} L_{i,t}                   (DAPO §3.3, token-level loss)
      "dr_grpo" (1/(B * max_completion_length)) sum_{i,t} L_{i,t} (Dr. GRPO, constant normaliser)
      "bnpo"    (1/sum_i |o_i|) sum_{i,t} L_{i,t}                 (token mean within this call)
    "grpo", "dapo" and "dr_grpo" give an optimizer step the same gradient however its mini-batch is split into
    equal micro-batches and ranks ("grpo" and "dr_grpo" because their normaliser is proportional to the rows of
    the call; "dapo" through ``num_items``). "bnpo" normalises by the tokens of each call, so by definition its
    step depends on the micro-batch size (a micro-batch of the whole mini-batch makes it "dapo").
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_lightning.importance import truncated_importance_weights

__all__ = ["group_advantages", "process_advantages", "grpo_loss", "truncated_importance_weights"]

_SCALES = ("group", "batch", "none")
_BASELINES = ("mean", "rloo")
_LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")
_KL_ESTIMATORS = ("k1", "k2", "k3")
_IS_LEVELS = ("token", "sequence")
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


def _masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    # torch.where rather than x * mask: garbage (inf/NaN) on padding must not leak through 0 * inf.
    x = torch.where(mask, x, torch.zeros_like(x))
    return x.sum() if dim is None else x.sum(dim=dim)


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return _masked_sum(x, mask) / mask.sum().clamp(min=1)


def _aggregate(
    per_token: Tensor, mask: Tensor, loss_type: str, num_items: int | float | Tensor | None, max_len: int | None
) -> Tensor:
    if loss_type == "grpo":
        row_loss = _masked_sum(per_token, mask, dim=1) / mask.sum(dim=1).clamp(min=1)
        # An empty row (all of its tokens masked out, e.g. a truncated completion under
        # mask_truncated_completions) counts as 0 in the mean: dividing by the rows of the call, not by the
        # non-empty ones, keeps the step's gradient independent of how its rows are cut into micro-batches
        # (which the trainer averages) and ranks (which DDP averages).
        return row_loss.sum() / max(mask.shape[0], 1)
    total = _masked_sum(per_token, mask)
    if loss_type == "dapo":
        # num_items is the token count of the whole rollout mini-batch (all micro-batches and ranks), so that
        # summing the micro-batch losses reproduces the full-batch token mean.
        denom = mask.sum() if num_items is None else torch.as_tensor(num_items, device=total.device)
        return total / denom.to(total.dtype).clamp(min=1)
    if loss_type == "dr_grpo":
        return total / (mask.shape[0] * max_len)
    return total / mask.sum().clamp(min=1)  # bnpo


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor | None,
    ref_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: str = "grpo",
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items: int | float | Tensor | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    engine_logprobs: Tensor | None = None,
    tis_cap: float | None = 2.0,
    tis_level: str = "token",
    tis_mode: str = "truncate",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped GRPO surrogate loss (to minimise) and detached metrics.

    Args:
        logprobs: ``[B, T]`` log-probs of the sampled tokens under the current policy (with grad).
        old_logprobs: ``[B, T]`` under the sampling policy; ``None`` means on-policy (ratio exactly 1,
            gradient is the plain policy gradient).
        ref_logprobs: ``[B, T]`` under the reference policy; ``None`` disables the KL term.
        advantages: ``[B]`` per completion, or ``[B, T]`` per token (process supervision).
        mask: ``[B, T]`` completion mask (bool or 0/1).
        loss_type: ``"grpo"``, ``"dapo"``, ``"dr_grpo"`` or ``"bnpo"`` (see module docstring).
        epsilon_low, epsilon_high: clip range ``[1 - epsilon_low, 1 + epsilon_high]``; high defaults to low.
        delta: upper cap on the ratio in the unclipped branch (two-sided clipping); ``None`` disables it.
        beta: KL coefficient; non-zero requires ``ref_logprobs``.
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        importance_sampling_level: ``"token"`` (GRPO) or ``"sequence"`` (GSPO).
        max_completion_length: normaliser of ``"dr_grpo"`` (required there).
        num_items: ``"dapo"`` denominator, the token count of the full rollout mini-batch; defaults to the
            tokens in this call.
        entropy: optional ``[B, T]`` per-token entropy; logged, and subtracted times ``entropy_coef``.
        entropy_coef: entropy bonus coefficient.
        engine_logprobs: ``[B, T]`` the sampling engine's own log-probs, when it is not the trainer (vLLM): the
            surrogate is then weighted by ``truncated_importance_weights`` (π_old = ``old_logprobs``, or the
            detached current log-probs when ``None``), capped at ``tis_cap`` (or masked outside [1/C, C] with
            ``tis_mode="mask"``), at ``tis_level``. At a rollout lag this is the decoupled objective: π_old is
            the proximal policy (the update's start), the engine's log-probs the stale sampler μ.

    Returns:
        ``(loss, metrics)``; metrics are detached scalars: ``pg_loss`` (surrogate only, same aggregation),
        ``kl``, ``clip_frac_low``, ``clip_frac_high``, ``clip_frac``, ``ratio_mean``, ``ratio_min``,
        ``ratio_max`` and ``entropy`` (when given), all token means over ``mask``; 0 when mask is empty.
    """
    _check_choice("loss_type", loss_type, _LOSS_TYPES)
    _check_choice("kl_estimator", kl_estimator, _KL_ESTIMATORS)
    _check_choice("importance_sampling_level", importance_sampling_level, _IS_LEVELS)
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    shape = logprobs.shape
    others = {
        "old_logprobs": old_logprobs,
        "ref_logprobs": ref_logprobs,
        "mask": mask,
        "entropy": entropy,
        "engine_logprobs": engine_logprobs,
    }
    for name, t in others.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} must have the shape of logprobs {tuple(shape)}, got {tuple(t.shape)}")
    if advantages.shape not in (shape[:1], shape):
        raise ValueError(f"advantages must be [B] or [B, T] = {tuple(shape)}, got {tuple(advantages.shape)}")
    if beta != 0 and ref_logprobs is None:
        raise ValueError("beta != 0 requires ref_logprobs")
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' requires max_completion_length")

    mask = mask.bool()
    zero = torch.zeros_like(logprobs)
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    adv = adv.to(logprobs.dtype)

    if old_logprobs is None:
        old_logprobs = logprobs.detach()
    log_ratio = torch.where(mask, logprobs - old_logprobs, zero)
    if importance_sampling_level == "sequence":
        # GSPO-token: the value of the length-normalised sequence ratio s_i on every token, the gradient of
        # each token's own log-prob (sg[s_i] * pi / sg[pi]). With one advantage per completion this is GSPO's
        # gradient exactly; with per-token advantages each token keeps its own.
        seq_log_ratio = (log_ratio.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).detach()
        log_ratio = torch.where(mask, seq_log_ratio.unsqueeze(1) + logprobs - logprobs.detach(), zero)
    ratio = torch.exp(log_ratio)

    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + eps_high)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    pg_per_token = -torch.min(unclipped * adv, clipped * adv)
    tis_metrics: dict[str, Tensor] = {}
    if engine_logprobs is not None:
        weights, tis_metrics = truncated_importance_weights(
            old_logprobs, engine_logprobs, mask, cap=tis_cap, level=tis_level, mode=tis_mode
        )
        pg_per_token = pg_per_token * weights
    per_token = pg_per_token

    kl = None
    if ref_logprobs is not None:
        d = torch.where(mask, ref_logprobs - logprobs, zero)
        if kl_estimator == "k1":
            kl = -d
        elif kl_estimator == "k2":
            kl = d.pow(2) / 2
        else:
            kl = torch.exp(d) - d - 1
        if beta != 0:
            per_token = per_token + beta * kl
    if entropy is not None and entropy_coef != 0:
        per_token = per_token - entropy_coef * entropy

    loss = _aggregate(per_token, mask, loss_type, num_items, max_completion_length)

    with torch.no_grad():
        low = (ratio < 1 - epsilon_low) & (adv < 0)
        high = (ratio > 1 + eps_high) & (adv > 0)
        any_token = mask.any()  # min/max over real tokens only; 0 (like the means) when there are none
        no_tokens = logprobs.new_zeros(())
        metrics = {
            "pg_loss": _aggregate(pg_per_token, mask, loss_type, num_items, max_completion_length),
            "kl": _masked_mean(kl, mask) if kl is not None else logprobs.new_zeros(()),
            "clip_frac_low": _masked_mean(low.to(logprobs.dtype), mask),
            "clip_frac_high": _masked_mean(high.to(logprobs.dtype), mask),
            "ratio_mean": _masked_mean(ratio, mask),
            "ratio_min": torch.where(any_token, torch.where(mask, ratio, torch.inf).min(), no_tokens),
            "ratio_max": torch.where(any_token, torch.where(mask, ratio, -torch.inf).max(), no_tokens),
        }
        metrics["clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
        if entropy is not None:
            metrics["entropy"] = _masked_mean(entropy, mask)
        metrics.update(tis_metrics)
    return loss, {k: v.detach() for k, v in metrics.items()}
