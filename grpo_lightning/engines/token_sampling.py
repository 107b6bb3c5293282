"""Drawing tokens from logits: temperature, top-k and top-p filtering, and an exact inverse-CDF draw.

Pure functions of tensors, shared by every engine that samples in PyTorch (``lean``; the ``transformers`` engine
uses ``generate``'s own processors, which these match).
"""

from __future__ import annotations

import torch
from torch import Tensor

# ``_cumsum_unit_``'s fixed point under deterministic algorithms off the CPU: steps of 2^-40, and a sum of up to
# 2^23 values in [0, 1] still fits in int64.
_FIXED_POINT = float(1 << 40)


def _cumsum_unit_(x: Tensor) -> Tensor:
    """``x.cumsum_(-1)`` of values in [0, 1], in place.

    Under ``torch.use_deterministic_algorithms`` (``trainer.deterministic``) off the CPU, where torch has no
    deterministic cumsum of floats and raises, the values are rounded to multiples of 2^-40 and summed exactly as
    int64 (in any order), so sampling and top-p work there too, bit for bit the same at every run.
    """
    if x.device.type == "cpu" or not torch.are_deterministic_algorithms_enabled():
        return x.cumsum_(-1)
    fixed = x.double().mul_(_FIXED_POINT).round_().long().cumsum_(-1)
    return x.copy_(fixed.double().div_(_FIXED_POINT))


def filter_logits(logits: Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Temperature, then top-k, then top-p (nucleus) filtering; removed tokens get -inf."""
    if temperature != 1.0:  # a full pass over [B, V] saved in the common case
        logits = logits / temperature
    if 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass; the first always stays.
        drop_sorted = _cumsum_unit_(probs.clone()) - probs >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(
    logits: Tensor,
    *,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """One token per row from ``logits`` ``[B, V]``: the argmax when ``greedy``, else a draw from the filtered
    softmax."""
    if greedy:
        return logits.argmax(-1)
    return draw(filter_logits(logits.float(), temperature=temperature, top_k=top_k, top_p=top_p), generator=generator)


def draw(scores: Tensor, *, generator: torch.Generator | None = None, uniform: Tensor | None = None) -> Tensor:
    """One token per row from ``softmax(scores)`` (``[B, V]``, float32; filtered tokens at -inf).

    The draw inverts the cumulative distribution with one uniform number per row, which is exact and several times
    cheaper than ``torch.multinomial`` (that draws an exponential variate for every vocabulary entry). ``uniform``
    ``[B, 1]``: those numbers, drawn by the caller (else from ``generator``).
    """
    # Unnormalised probabilities: comparing against u × total mass is the same as normalising first. Filtered
    # tokens have zero mass, so the cumulative sum is flat there and they are never the first index reaching u.
    cdf = _cumsum_unit_((scores - scores.amax(-1, keepdim=True)).exp_())
    if uniform is None:
        uniform = torch.rand(cdf.size(0), 1, device=cdf.device, generator=generator)
    threshold = (1.0 - uniform) * cdf[:, -1:]  # in (0, total]: never selects a token of zero mass at index 0
    return (cdf < threshold).sum(-1).clamp_(max=cdf.size(-1) - 1)
