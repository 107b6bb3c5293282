"""How per-token losses L_{i,t} become one number: the aggregation, a choice apart from the loss itself.

``B`` rows in this call (a micro-batch), |o_i| the tokens of completion i that count:

==========================  ===============================================  ===================================
``sequence_mean``           (1/B) Σ_i (1/|o_i|) Σ_t L_{i,t}                  GRPO (DeepSeekMath §4.1.1); SAPO
``token_mean``              (1/num_items) Σ_{i,t} L_{i,t}                    DAPO §3.3 (token-level); CISPO
``micro_batch_token_mean``  (1/Σ_i |o_i|) Σ_{i,t} L_{i,t}                    BNPO / TRL's "bnpo"
``constant``                (1/(B · max_completion_length)) Σ_{i,t} L_{i,t}  Dr. GRPO (Liu et al. 2025)
``sequence_sum``            (1/B) Σ_i Σ_t L_{i,t}                            LUSPO (length-weighted sequences)
==========================  ===============================================  ===================================

An empty row (every token masked, e.g. a truncated completion under ``mask_truncated_completions``) counts as 0
with the row-based ones. Given the step's totals, ``num_rows`` (B of the whole optimizer step: all micro-batches,
all ranks) and ``num_items`` (its loss tokens), every aggregation but ``micro_batch_token_mean`` divides by a
number of the step, not of the call: the trainer then multiplies each micro-batch's loss back by the number of
micro-batches and ranks (``STEP_NORMALISED``), and a step's gradient is the same however its rows are grouped
into micro-batches (equal row counts or balanced token counts) and ranks. Without them (a single call), B is the
rows of the call. ``micro_batch_token_mean`` normalises by the tokens of each call, so by definition its step
depends on the grouping (one micro-batch of the whole mini-batch makes it ``token_mean``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_lightning.losses.inputs import masked_sum

AGGREGATIONS = ("sequence_mean", "token_mean", "micro_batch_token_mean", "constant", "sequence_sum")
STEP_NORMALISED = ("sequence_mean", "token_mean", "constant", "sequence_sum")
"""Aggregations whose normaliser spans the optimizer step (given ``num_rows`` / ``num_items``): the trainer undoes
the averaging over micro-batches and ranks for them."""


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    aggregation: str,
    *,
    num_items: int | float | Tensor | None = None,
    num_rows: int | float | Tensor | None = None,
    max_completion_length: int | None = None,
) -> Tensor:
    """One scalar from ``[B, T]`` per-token losses (see the module's table).

    Args:
        per_token: ``[B, T]`` losses (anything on padding).
        mask: ``[B, T]`` bool, the tokens that count.
        aggregation: one of ``AGGREGATIONS``.
        num_items: ``token_mean``'s denominator, the token count of the whole optimizer step; defaults to the
            tokens of this call.
        num_rows: B of the row-based aggregations, the rows of the whole optimizer step; defaults to the rows of
            this call.
        max_completion_length: ``constant``'s normaliser (required there).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    rows = mask.shape[0] if num_rows is None else torch.as_tensor(num_rows, device=per_token.device)
    rows = rows.to(per_token.dtype).clamp(min=1) if isinstance(rows, Tensor) else max(rows, 1)
    if aggregation == "sequence_mean":
        return (masked_sum(per_token, mask, dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / rows
    if aggregation == "sequence_sum":
        return masked_sum(per_token, mask) / rows
    total = masked_sum(per_token, mask)
    if aggregation == "token_mean":
        denom = mask.sum() if num_items is None else torch.as_tensor(num_items, device=total.device)
        return total / denom.to(total.dtype).clamp(min=1)
    if aggregation == "constant":
        if max_completion_length is None:
            raise ValueError("aggregation 'constant' (Dr. GRPO) requires max_completion_length")
        return total / (rows * max_completion_length)
    return total / mask.sum().clamp(min=1)  # micro_batch_token_mean
