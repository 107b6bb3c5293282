"""``grpo_loss``: the whole objective of one micro-batch, assembled from the pieces of this package.

    L = aggregate( m_t · w_t · L^policy_t + β · KL_t − c · H_t )

- L^policy: the chosen policy loss (``registry``; ``clipped.py``, ``cispo.py``, ``sapo.py``, ``gmpo.py``,
  ``vespo.py`` or a user's function);
- w_t: the sampler correction π_old / π_engine when the engine that sampled is not the trainer
  (``importance.truncated_importance_weights``), unless the loss folds it in itself;
- m_t: DeepSeek-V3.2's off-policy sequence mask (``off_policy_mask`` = δ): a completion with A < 0 whose mean
  per-token KL(π_sampler ‖ π_θ) estimate, log π_sampler − log π_θ, exceeds δ leaves the policy term (it was
  sampled by a policy too far from the current one to be a trustworthy negative example); its KL term stays;
- KL_t: ``kl.kl_estimate`` (k1, k2, k3), optionally importance-weighted (``kl_importance_weighted``) by
  π_θ/π_old · w_t, the whole way from the sampler (``kl.py`` says what that estimates when w_t is truncated);
- H_t: the entropy bonus, on the tokens the top-entropy-quantile mask keeps (``entropy.py``; all of them at ρ = 1),
  which also leaves the policy term on those tokens only;
- aggregate: ``aggregation.aggregate``, the loss's default or a compatible choice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from grpo_lightning.importance import truncated_importance_weights
from grpo_lightning.losses.aggregation import aggregate
from grpo_lightning.losses.entropy import entropy_threshold, high_entropy_mask
from grpo_lightning.losses.inputs import LEVELS, LossInputs, masked_mean, sequence_mean
from grpo_lightning.losses.kl import KL_ESTIMATORS, importance_weighted_kl, kl_estimate
from grpo_lightning.losses.registry import check_policy_loss


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor | None,
    ref_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: str = "grpo",
    aggregation: str | None = None,
    epsilon_low: float | None = None,
    epsilon_high: float | None = None,
    delta: float | None = None,
    clip_ratio_c: float | None = None,
    importance_sampling_level: str | None = None,
    loss_kwargs: Mapping[str, Any] | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    kl_importance_weighted: bool = False,
    off_policy_mask: float | None = None,
    max_completion_length: int | None = None,
    num_items: int | float | Tensor | None = None,
    num_rows: int | float | Tensor | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    top_entropy_quantile: float = 1.0,
    entropy_pool: Tensor | None = None,
    generator: torch.Generator | None = None,
    engine_logprobs: Tensor | None = None,
    tis_cap: float | None = 2.0,
    tis_level: str = "token",
    tis_mode: str = "truncate",
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss to minimise for one micro-batch, and detached metrics.

    Args:
        logprobs: ``[B, T]`` log-probs of the sampled tokens under the current policy (with grad).
        old_logprobs: ``[B, T]`` under π_old; ``None`` means on-policy (ratio exactly 1, the plain policy gradient).
        ref_logprobs: ``[B, T]`` under the reference policy; ``None`` disables the KL term.
        advantages: ``[B]`` per completion, or ``[B, T]`` per token (process supervision).
        mask: ``[B, T]`` completion mask (bool or 0/1).
        loss_type: a registered policy loss (``available_policy_losses()``) or ``package.module:function``.
        aggregation: ``aggregation.AGGREGATIONS``; ``None`` is the loss's own (a contradicting one is refused).
        epsilon_low, epsilon_high, delta, clip_ratio_c, importance_sampling_level: the generic settings, passed to
            the losses that read them; ``None`` leaves the loss's default (a set value the loss does not read is
            refused).
        loss_kwargs: the loss's other settings (e.g. SAPO's ``tau_pos``).
        beta: KL coefficient; non-zero requires ``ref_logprobs``.
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        kl_importance_weighted: multiply each token's KL estimate by π_θ/μ, μ the sampler: the ratio π_θ/π_old
            times the policy term's behaviour weights π_old/μ when ``engine_logprobs`` are given (truncated or
            masked alike; of 1 with ``tis_cap=None``). Unbiased for k1 and k3 at lag 0 with the trainer as
            sampler or with untruncated weights; ``kl.py`` says what it estimates otherwise.
        off_policy_mask: δ of the off-policy sequence mask (module docstring); ``None`` disables it.
        max_completion_length: the ``constant`` aggregation's normaliser (Dr. GRPO; required there).
        num_items: the ``token_mean`` denominator, the token count of the whole optimizer step; defaults to the
            tokens in this call.
        num_rows: the row-based aggregations' B, the rows of the whole optimizer step; defaults to the rows in
            this call (``aggregation.py``).
        entropy: optional ``[B, T]`` per-token entropy; logged, and subtracted times ``entropy_coef``.
        entropy_coef: entropy bonus coefficient.
        top_entropy_quantile: ρ in (0, 1]: only the tokens whose entropy is at or above the (1 − ρ) quantile of
            ``entropy_pool`` keep their policy term and entropy bonus (TRL's mask; ``losses/entropy.py``); the KL
            term is kept everywhere and the aggregation still counts every token. Needs ``entropy``.
        entropy_pool: the entropies the quantile is taken over, NaN entries ignored (the module passes every
            rank's tokens of the micro-batch); default ``entropy`` under ``mask``.
        generator: the random source of a loss that draws (``LossInputs.generator``: Clip-Cov's selection);
            ``None``: torch's global generator of the tensors' device.
        engine_logprobs: ``[B, T]`` the sampling engine's own log-probs when it is not the trainer (vLLM, or an
            older policy at a rollout lag): the policy term (and an importance-weighted KL term) is weighted by
            ``truncated_importance_weights`` (π_old = ``old_logprobs``, or the detached current log-probs when
            ``None``), capped at ``tis_cap`` (or masked outside [1/C, C] with ``tis_mode="mask"``), at
            ``tis_level``.

    Returns:
        ``(loss, metrics)``; metrics are detached scalars: ``pg_loss`` (the policy term, same aggregation),
        ``kl``, ``ratio_mean``/``ratio_min``/``ratio_max`` (at the loss's ratio level), ``entropy`` (when given),
        the loss's own (the clipped losses: ``clip_frac_low``, ``clip_frac_high``, ``clip_frac``), the sampler
        correction's, ``off_policy_masked_frac`` and, at ρ < 1, ``top_entropy_threshold`` (the entropy the mask
        starts at; 0 without tokens) and ``top_entropy_frac`` (the tokens kept); token means over ``mask``, 0 when
        it is empty.
    """
    shape = logprobs.shape
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(shape)}")
    tensors = {"old_logprobs": old_logprobs, "ref_logprobs": ref_logprobs, "mask": mask}
    tensors.update(entropy=entropy, engine_logprobs=engine_logprobs)
    for name, t in tensors.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} must have the shape of logprobs {tuple(shape)}, got {tuple(t.shape)}")
    if advantages.shape not in (shape[:1], shape):
        raise ValueError(f"advantages must be [B] or [B, T] = {tuple(shape)}, got {tuple(advantages.shape)}")
    if beta != 0 and ref_logprobs is None:
        raise ValueError("beta != 0 requires ref_logprobs")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    if not 0 < top_entropy_quantile <= 1:
        raise ValueError(f"top_entropy_quantile must be in (0, 1], got {top_entropy_quantile}")
    if top_entropy_quantile < 1 and entropy is None:
        raise ValueError("top_entropy_quantile < 1 needs the per-token entropy")
    if importance_sampling_level not in (None, *LEVELS):
        raise ValueError(f"importance_sampling_level must be one of {LEVELS}, got {importance_sampling_level!r}")
    generic = {"epsilon_low": epsilon_low, "epsilon_high": epsilon_high, "delta": delta}
    generic.update(clip_ratio_c=clip_ratio_c, importance_sampling_level=importance_sampling_level)
    loss_kwargs = dict(loss_kwargs or {})
    policy = check_policy_loss(loss_type, generic, loss_kwargs, aggregation)
    aggregation = aggregation or policy.aggregation
    if aggregation == "constant" and max_completion_length is None:
        raise ValueError(f"loss_type {loss_type!r} with aggregation 'constant' requires max_completion_length")
    if policy.corrects_sampler and engine_logprobs is not None and tis_level != "token":
        raise ValueError(f"loss_type {loss_type!r} folds the token weights of the sampler in: use tis_level token")
    level = policy.ratio_level(importance_sampling_level)

    mask = mask.bool()
    adv = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages).to(logprobs.dtype).expand(shape)
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    is_weights, correction_metrics = None, {}
    if engine_logprobs is not None:
        is_weights, correction_metrics = truncated_importance_weights(
            old, engine_logprobs, mask, cap=tis_cap, level=tis_level, mode=tis_mode
        )
    inputs = LossInputs(logprobs, old, adv, mask, ref_logprobs, engine_logprobs, is_weights, generator)

    pg_per_token, loss_metrics = policy(inputs, generic, loss_kwargs)
    if pg_per_token.shape != shape:
        raise ValueError(f"loss_type {loss_type!r} returned a per-token loss of shape {tuple(pg_per_token.shape)}")
    if is_weights is not None and not policy.corrects_sampler:
        pg_per_token = pg_per_token * is_weights
    if off_policy_mask is not None:
        sampler = old if engine_logprobs is None else engine_logprobs
        drift = torch.nan_to_num(torch.where(mask, sampler - logprobs.detach(), torch.zeros_like(old)), nan=0.0)
        dropped = (adv < 0) & (sequence_mean(drift, mask) > off_policy_mask).unsqueeze(1)
        pg_per_token = torch.where(dropped, torch.zeros_like(pg_per_token), pg_per_token)
        correction_metrics["off_policy_masked_frac"] = masked_mean(dropped.to(old.dtype), mask)
    kept = mask  # the tokens whose policy term and entropy bonus count
    if top_entropy_quantile < 1:
        threshold = entropy_threshold(entropy, mask, top_entropy_quantile, pool=entropy_pool)
        kept = high_entropy_mask(entropy, mask, threshold)
        pg_per_token = torch.where(kept, pg_per_token, torch.zeros_like(pg_per_token))
        correction_metrics["top_entropy_threshold"] = torch.where(threshold.isfinite(), threshold, 0.0)
        correction_metrics["top_entropy_frac"] = masked_mean(kept.to(old.dtype), mask)
    per_token = pg_per_token

    kl = None
    if ref_logprobs is not None:
        kl = kl_estimate(logprobs, ref_logprobs, mask, kl_estimator)
        if beta != 0:
            per_token = per_token + beta * (importance_weighted_kl(kl, inputs, level) if kl_importance_weighted else kl)
    if entropy is not None and entropy_coef != 0:
        per_token = per_token - entropy_coef * torch.where(kept, entropy, torch.zeros_like(entropy))

    settings = {"num_items": num_items, "num_rows": num_rows, "max_completion_length": max_completion_length}
    loss = aggregate(per_token, mask, aggregation, **settings)

    with torch.no_grad():
        ratio = inputs.ratio(level)
        any_token = mask.any()  # min/max over real tokens only; 0 (like the means) when there are none
        none = logprobs.new_zeros(())
        metrics = {
            "pg_loss": aggregate(pg_per_token, mask, aggregation, **settings),
            "kl": masked_mean(kl, mask) if kl is not None else logprobs.new_zeros(()),
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_min": torch.where(any_token, torch.where(mask, ratio, torch.inf).min(), none),
            "ratio_max": torch.where(any_token, torch.where(mask, ratio, -torch.inf).max(), none),
            **loss_metrics,
        }
        if "clip_frac_low" in metrics and "clip_frac_high" in metrics:
            metrics["clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy, mask)
        metrics.update(correction_metrics)
    return loss, {k: v.detach() for k, v in metrics.items()}
