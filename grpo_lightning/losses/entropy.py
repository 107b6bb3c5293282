"""Entropy control: the top-entropy-quantile token mask and the adaptive entropy coefficient, as TRL 1.16 has them.

- **The top-entropy-quantile mask** ("Beyond the 80/20 Rule", Wang et al. 2025; TRL's ``top_entropy_quantile``
  ρ): only the tokens whose entropy is at or above the (1 − ρ) quantile of the micro-batch's loss tokens (all
  ranks') keep their policy-gradient term. The threshold is ``torch.quantile``'s, linear interpolation between
  order statistics; the entropy is only compared, so no gradient flows through the mask. The KL term is not
  masked; the entropy bonus acts on the kept tokens only (as TRL's).
- **The adaptive coefficient** (Skywork-OR1, He et al. 2025; TRL's ``use_adaptive_entropy``): after each optimizer
  step, with H the token-weighted mean entropy of the step's kept tokens (all micro-batches, all ranks; 0 when
  there is none, as TRL's ``clamp(min=1)`` makes it), c ← min(c + δ, c_max) if H ≤ target else max(c − δ, c_min).
  The bonus −c·H_t is applied only while the previous step's H was at or below the target (none at the first
  step): ``EntropyControl``.

The state across micro-batches, ranks and checkpoints is ``EntropyControl``'s; the reductions over ranks are
passed in by the caller (``GRPOModule``), so that this file stays free of Lightning.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def entropy_threshold(entropy: Tensor, mask: Tensor, quantile: float, pool: Tensor | None = None) -> Tensor:
    """The entropy at the (1 − ``quantile``) quantile of the loss tokens: the lowest one the mask keeps.

    ``torch.quantile``'s linear interpolation, in float32 as TRL computes it, without its size limit (2^24 values)
    and without a device sync. ``pool``: the values to take it over, NaN entries ignored (every rank's tokens,
    NaN-padded); default ``entropy`` under ``mask``. ``inf`` when there is no value: nothing is kept.
    """
    if not 0 < quantile <= 1:
        raise ValueError(f"top_entropy_quantile must be in (0, 1], got {quantile}")
    nan = torch.full_like(entropy, math.nan, dtype=torch.float32)
    values = torch.where(mask.bool(), entropy.detach().float(), nan) if pool is None else pool.detach().float()
    values = values.flatten()
    valid = ~values.isnan()
    count = valid.sum()
    ordered = torch.where(valid, values, math.inf).sort().values  # the valid values first, in order
    # torch.quantile's arithmetic: rank = q · (n − 1) in the values' dtype, then lerp between its neighbours.
    rank = torch.tensor(1.0 - quantile, dtype=torch.float32, device=values.device) * (count - 1).clamp(min=0)
    below, above = rank.floor().long().view(1), rank.ceil().long().view(1)
    threshold = torch.lerp(ordered.gather(0, below), ordered.gather(0, above), rank - below).squeeze(0)
    return torch.where(count > 0, threshold, math.inf)


def high_entropy_mask(entropy: Tensor, mask: Tensor, threshold: Tensor) -> Tensor:
    """The loss tokens whose entropy is at or above ``threshold`` (bool, ``[B, T]``; TRL's ``>=``)."""
    return mask.bool() & (entropy.detach().float() >= threshold)


def all_ranks_pool(entropy: Tensor, mask: Tensor, all_gather: Callable[[Tensor], Tensor]) -> Tensor:
    """Every rank's loss-token entropies of its micro-batch, one NaN-padded vector (``entropy_threshold``'s
    ``pool``). ``all_gather``: a collective stacking a same-shaped tensor of every rank (call it on every rank)."""
    local = torch.where(mask.bool(), entropy.detach().float(), math.nan).flatten()
    sizes = all_gather(torch.tensor([local.numel()], device=local.device))
    padded = torch.full((int(sizes.max()),), math.nan, device=local.device)  # micro-batches differ in shape
    padded[: local.numel()] = local
    return all_gather(padded).flatten()


def next_entropy_coef(
    coef: float, entropy: float, *, target: float, delta: float, coef_min: float, coef_max: float
) -> float:
    """One step of the adaptive coefficient: up by ``delta`` (to ``coef_max``) when the measured entropy is at or
    below ``target``, else down by ``delta`` (to ``coef_min``)."""
    if entropy <= target:
        return min(coef + delta, coef_max)
    return max(coef - delta, coef_min)


def entropy_settings_problem(settings: Any) -> str | None:
    """What cannot work in the entropy settings of ``settings`` (``model.objective``'s fields, by name): one line
    that starts with the setting's name, or ``None``."""
    quantile, delta, target = settings.top_entropy_quantile, settings.entropy_coef_delta, settings.entropy_target
    low, high, start = settings.entropy_coef_min, settings.entropy_coef_max, settings.entropy_coef
    if not 0 < quantile <= 1:
        return (
            f"top_entropy_quantile must be in (0, 1] (got {quantile}): the fraction of tokens, by entropy, that keep "
            "their policy term (the paper's 0.2; 1 keeps every token)"
        )
    if delta <= 0:
        return f"entropy_coef_delta must be > 0 (got {delta})"
    if not 0 <= low <= high:
        return f"entropy_coef_min and entropy_coef_max must satisfy 0 <= min <= max (got {low}, {high})"
    if target < 0:
        return f"entropy_target must be >= 0 nats (got {target})"
    if settings.use_adaptive_entropy and not low <= start <= high:
        return (
            f"entropy_coef = {start} (the adaptive coefficient's start) must be within [entropy_coef_min, "
            f"entropy_coef_max] = [{low}, {high}]"
        )
    return None


class EntropyControl:
    """The entropy terms of a run: the quantile of the token mask, and the bonus's coefficient, fixed or adaptive
    (module docstring).

    Per micro-batch the caller takes ``pool`` (every rank's tokens, for the quantile) and ``applied`` (the
    coefficient), then feeds the entropy back (``accumulate``); once per optimizer step it calls ``step``.
    ``state_dict`` holds what a resumed run needs to continue exactly (the coefficient, the last step's entropy).
    """

    def __init__(
        self,
        coef: float,
        *,
        quantile: float = 1.0,
        adaptive: bool = False,
        target: float = 0.2,
        delta: float = 0.005,
        coef_min: float = 0.0,
        coef_max: float = 1.0,
    ) -> None:
        self.coef, self.quantile, self.adaptive = float(coef), quantile, adaptive
        self.settings = {"target": target, "delta": delta, "coef_min": coef_min, "coef_max": coef_max}
        self.last_entropy = math.inf  # the previous step's measured entropy: inf, so no bonus before the first
        self._window: Tensor | None = None  # [entropy sum, tokens] of the current step's micro-batches so far

    @classmethod
    def from_settings(cls, settings: Any) -> EntropyControl:
        """As a run starts, from ``model.objective``'s fields (``entropy_coef``, ``top_entropy_quantile``, ...)."""
        return cls(
            settings.entropy_coef,
            quantile=settings.top_entropy_quantile,
            adaptive=settings.use_adaptive_entropy,
            target=settings.entropy_target,
            delta=settings.entropy_coef_delta,
            coef_min=settings.entropy_coef_min,
            coef_max=settings.entropy_coef_max,
        )

    @property
    def active(self) -> bool:
        """Whether the loss has an entropy bonus at all (a non-zero coefficient, or an adaptive one)."""
        return self.adaptive or self.coef != 0

    @property
    def needs_entropy(self) -> bool:
        """Whether the loss reads the per-token entropy (a bonus, or the quantile mask)."""
        return self.active or self.quantile < 1

    @property
    def applied(self) -> float:
        """The coefficient of the current step: the adaptive one only while the last entropy was at or below the
        target (TRL's gate)."""
        if self.adaptive and not self.last_entropy <= self.settings["target"]:
            return 0.0
        return self.coef

    def pool(
        self, entropy: Tensor | None, mask: Tensor, all_gather: Callable[[Tensor], Tensor] | None
    ) -> Tensor | None:
        """The tokens the quantile is taken over: every rank's (``all_ranks_pool``) with ``all_gather`` (``None``:
        one process) and the mask on; ``None`` otherwise (``grpo_loss`` then takes the micro-batch's)."""
        if self.quantile >= 1 or all_gather is None or entropy is None:
            return None
        return all_ranks_pool(entropy, mask, all_gather)

    def loss_settings(
        self, entropy: Tensor | None, mask: Tensor, all_gather: Callable[[Tensor], Tensor] | None
    ) -> dict[str, Any]:
        """``grpo_loss``'s entropy arguments for a micro-batch: the entropy (detached when no bonus acts on it: no
        backward through it), the step's coefficient (``applied``), the quantile and its ``pool``."""
        coef = self.applied
        return {
            "entropy": entropy.detach() if entropy is not None and coef == 0 else entropy,
            "entropy_coef": coef,
            "top_entropy_quantile": self.quantile,
            "entropy_pool": self.pool(entropy, mask, all_gather),
        }

    def accumulate(self, entropy: Tensor | None, mask: Tensor, threshold: Tensor | None = None) -> None:
        """Add a micro-batch's entropy over the tokens the policy term keeps: ``mask``, or those at or above
        ``threshold`` (``grpo_loss``'s ``top_entropy_threshold``) under the quantile mask."""
        if not self.adaptive or entropy is None:
            return
        kept = mask.bool() if threshold is None else high_entropy_mask(entropy, mask, threshold)
        total = torch.where(kept, entropy.detach().float(), 0.0).sum()
        stats = torch.stack([total, kept.sum().float()])
        self._window = stats if self._window is None else self._window + stats

    def step(
        self,
        reduce: Callable[..., Tensor] | None = None,
        *,
        skipped: bool = False,
        log: Callable[..., Any] | None = None,
    ) -> None:
        """End of an optimizer step: measure the step's entropy over all ranks and move the adaptive coefficient.
        ``reduce``: a Lightning strategy's, called with ``reduce_op="sum"`` (``None``: one process). A ``skipped``
        step (its weights left as they were, the non-finite guard) moves nothing. ``log``: a LightningModule's,
        given ``train/entropy_coef`` after the step (TRL logs it so) when there is a bonus."""
        window, self._window = self._window, None
        if self.adaptive and not skipped and window is not None:
            totals = reduce(window, reduce_op="sum") if reduce is not None else window
            entropy = float(totals[0] / totals[1].clamp(min=1.0))  # the step's one device sync
            self.coef = next_entropy_coef(self.coef, entropy, **self.settings)
            self.last_entropy = entropy
        if log is not None and self.active:
            log("train/entropy_coef", self.coef, on_step=True, batch_size=1)

    def clear_window(self) -> None:
        """Forget the micro-batches of a step that will not come (a fit stopped inside an accumulation window)."""
        self._window = None

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict``'s values; an empty state (a checkpoint from before them) keeps the start."""
        self.coef = float(state.get("coef", self.coef))
        self.last_entropy = float(state.get("last_entropy", self.last_entropy))
