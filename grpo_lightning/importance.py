"""Importance weights of π_old over the sampler that drew the tokens, as a pure tensor function.

The sampler can differ from π_old in two ways: its kernels or copy of the weights (vLLM), or its age (a rollout
lag, where π_old is the proximal policy at the update's start and the sampler μ is L rounds older). Either way
each token's surrogate is weighted by w = π_old / μ (``grpo_loss(engine_logprobs=...)``), truncated at C
(truncated importance sampling, Yao et al. 2025) or masked outside [1/C, C] (IcePop-style rejection), per token
or per sequence (the product of a completion's token ratios). With π_old the proximal policy this is the behaviour
weight of the decoupled PPO objective (Hilton et al. 2022; AReaL).
"""

from __future__ import annotations

import torch
from torch import Tensor

_LEVELS = ("token", "sequence")
_MODES = ("truncate", "mask")


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    # torch.where rather than x * mask: garbage (inf/NaN) on padding must not leak through 0 * inf.
    return torch.where(mask, x, torch.zeros_like(x)).sum() / mask.sum().clamp(min=1)


def truncated_importance_weights(
    old_logprobs: Tensor,
    engine_logprobs: Tensor,
    mask: Tensor,
    *,
    cap: float | None = 2.0,
    level: str = "token",
    mode: str = "truncate",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance-sampling weights ``[B, T]`` of π_old over the sampler (no gradient) and mismatch metrics.

    The behaviour weight of the decoupled objective (Hilton et al. 2022; AReaL) when π_old is the proximal policy
    and the engine's log-probs are the (older, or other-kernel) sampler μ: w = π_old / μ, then

    - ``truncate``: min(w, C) (truncated importance sampling, Yao et al. 2025);
    - ``mask``: w kept where 1/C <= w <= C, 0 elsewhere (the token, or at sequence level the completion, leaves
      the surrogate: IcePop-style rejection instead of a cap).

    Args:
        old_logprobs: ``[B, T]`` the trainer's log-probs of π_old (the proximal policy at a lag).
        engine_logprobs: ``[B, T]`` the engine's own log-probs of the same tokens (what it sampled from).
        mask: ``[B, T]`` tokens that count.
        cap: C; ``None`` keeps the weights at 1 (the metrics are still computed).
        level: ``"token"`` (one weight per token) or ``"sequence"`` (the product of a completion's token ratios).
        mode: ``"truncate"`` or ``"mask"``.

    Returns:
        ``(weights, metrics)``; metrics (token means over ``mask``): ``mismatch_abs_logprob`` (mean
        |log π_old − log π_engine|), ``mismatch_kl`` (KL(π_engine ‖ π_old), k3 estimator on the engine's samples),
        ``tis_truncated_frac`` (share of tokens, or of completions at sequence level, whose weight was capped or
        masked) and ``tis_weight_mean``.
    """
    if level not in _LEVELS or mode not in _MODES:
        raise ValueError(f"tis level must be one of {_LEVELS} and mode one of {_MODES} (got {level!r}, {mode!r})")
    mask = mask.bool()
    zero = torch.zeros_like(old_logprobs)
    log_ratio = torch.where(mask, old_logprobs - engine_logprobs, zero).detach()
    ratio = torch.exp(log_ratio.sum(dim=1, keepdim=True).expand_as(log_ratio) if level == "sequence" else log_ratio)
    if cap is None:
        outside = torch.zeros_like(mask)
    elif mode == "mask":
        outside = (ratio > cap) | (ratio < 1 / cap)
    else:
        outside = ratio > cap
    if level == "sequence":
        counted = mask.any(dim=1)
        first = outside[:, 0].to(ratio.dtype)
        truncated_frac = first[counted].mean() if counted.any() else ratio.new_zeros(())
    else:
        truncated_frac = _masked_mean(outside.to(ratio.dtype), mask)
    if cap is None:
        weights = torch.ones_like(ratio)
    elif mode == "mask":
        weights = torch.where(outside, zero, ratio)
    else:
        weights = torch.clamp(ratio, max=cap)
    weights = torch.where(mask, weights, zero)
    metrics = {
        "mismatch_abs_logprob": _masked_mean(log_ratio.abs(), mask),
        "mismatch_kl": _masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask),
        "tis_truncated_frac": truncated_frac,
        "tis_weight_mean": _masked_mean(weights, mask),
    }
    return weights, metrics
