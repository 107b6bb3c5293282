"""``LossInputs``: the tensors every policy loss reads, and the importance ratios they are built from.

Shapes: ``B`` completions, ``T`` padded completion tokens; ``mask`` marks the tokens that count. All tensors are
``[B, T]``; advantages arrive broadcast to ``[B, T]`` (one value per completion repeated, or per token with process
rewards). Padding may hold anything (even inf/NaN): every reduction here goes through ``torch.where(mask, ...)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

LEVELS = ("token", "sequence")


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over ``mask`` (all of it, or along ``dim``)."""
    # torch.where rather than x * mask: garbage (inf/NaN) on padding must not leak through 0 * inf.
    x = torch.where(mask, x, torch.zeros_like(x))
    return x.sum() if dim is None else x.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Token mean of ``x`` over ``mask``; 0 when no token counts."""
    return masked_sum(x, mask) / mask.sum().clamp(min=1)


def sequence_mean(x: Tensor, mask: Tensor) -> Tensor:
    """``[B]``: each completion's mean of ``x`` over its tokens (0 for an empty completion)."""
    return masked_sum(x, mask, dim=1) / mask.sum(dim=1).clamp(min=1)


@dataclass(frozen=True)
class LossInputs:
    """What a policy loss sees, π_θ with gradient and everything else without.

    Attributes:
        logprobs: log π_θ of the sampled tokens (carries the gradient).
        old_logprobs: log π_old, the policy at the update's start (``logprobs.detach()`` when on-policy).
        advantages: A per token (a completion's advantage on each of its tokens).
        mask: bool, the tokens that count.
        ref_logprobs: log π_ref, or ``None`` without a reference model.
        engine_logprobs: the sampling engine's own log-probs when it is not the trainer (vLLM, or an older policy
            at a rollout lag), else ``None``.
        is_weights: the truncated importance weights π_old / π_engine (``importance.truncated_importance_weights``)
            when ``engine_logprobs`` is given, else ``None``. The objective multiplies every loss by them, except a
            loss registered with ``corrects_sampler=True``, which folds them in itself, and the importance-weighted
            KL term by them (``kl.py``).
        generator: the random source of a loss that draws (Clip-Cov's random selection, ``covariance.py``);
            ``None``: torch's global generator of the tensors' device (restored with the RNG states on resume).
    """

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    ref_logprobs: Tensor | None = None
    engine_logprobs: Tensor | None = None
    is_weights: Tensor | None = None
    generator: torch.Generator | None = None

    def log_ratio(self) -> Tensor:
        """log ρ_t = log π_θ − log π_old per token, 0 on padding (with gradient)."""
        return torch.where(self.mask, self.logprobs - self.old_logprobs, torch.zeros_like(self.logprobs))

    def sequence_log_ratio(self) -> Tensor:
        """``[B]``: log s_i = mean_t log ρ_t, GSPO's length-normalised sequence ratio (with gradient)."""
        return sequence_mean(self.log_ratio(), self.mask)

    def ratio(self, level: str = "token") -> Tensor:
        """ρ per token: ``token`` π_θ/π_old; ``sequence`` GSPO's s_i on every token of completion i.

        The sequence ratio is returned in the GSPO-token form s_{i,t} = sg[s_i] · π_θ(y_t) / sg[π_θ(y_t)]: the
        value s_i on each token, the gradient of each token's own log-prob. Any loss that depends on the token
        only through (s_i, A_i) then has GSPO's gradient exactly (the token terms sum to d s_i); with per-token
        advantages it is GSPO-token (Zheng et al. 2025, §4.3).
        """
        if level not in LEVELS:
            raise ValueError(f"importance_sampling_level must be one of {LEVELS}, got {level!r}")
        log_ratio = self.log_ratio()
        if level == "sequence":
            seq = self.sequence_log_ratio().detach().unsqueeze(1)
            log_ratio = torch.where(self.mask, seq + self.logprobs - self.logprobs.detach(), log_ratio)
        return torch.exp(log_ratio)
