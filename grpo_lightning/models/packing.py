"""Padding-free log-prob passes: a micro-batch's sequences concatenated into token-budget bins.

Why: completions of a reasoning model differ in length by 10× or more; padding every row to the longest one spends
the forward and backward of every layer on padding (its share is 1 − mean/max of the lengths). Here each sequence's
real tokens are laid end to end in bins of at most ``budget`` tokens (first-fit decreasing), every bin padded only
to the longest bin, and attention is restricted to each sequence's own tokens:

- the lean forward (``LeanPacking``): each distinct prompt still runs once (``run_prompts``); a bin holds
  completion tokens only, each attending to the keys of its own prompt and, causally, of its own completion, through
  one boolean mask per bin; positions continue after the prompt's real tokens;
- the model's own forward (``FullPacking``): prompt and completion tokens of each sequence, position ids restarting
  at 0 per sequence and no attention mask, from which ``transformers`` builds a block-diagonal mask (SDPA, eager,
  flex) or variable-length flash attention. ``packing_isolates`` checks once per model that its attention really
  keeps packed sequences apart; a model where it does not falls back to padded batches (one log line).

With ``budget`` = the longest sequence (the default) a bin costs what one padded row costs, and there are about
mean/max as many bins as rows. A layout is built on the host from the micro-batch's masks before its forward (one
device sync per packed micro-batch; a padded one given its precomputed ``LogprobLayout`` makes none).
"""

from __future__ import annotations

import logging
import weakref
from typing import NamedTuple

import torch
from torch import Tensor, nn

from grpo_lightning.models.lean_forward import (
    PromptGroups,
    _repeat_rows,
    decoder_hidden,
    final_norm,
    run_prompts,
)

log = logging.getLogger(__name__)


def plan_bins(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of ``lengths`` in bins of at most ``budget`` tokens, first-fit decreasing (a sequence longer than the
    budget gets a bin of its own). Deterministic: ties are taken in index order; bins keep their sequences in the
    order they were placed."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        size = lengths[index]
        for b, free in enumerate(room):
            if size <= free:
                bins[b].append(index)
                room[b] -= size
                break
        else:
            bins.append([index])
            room.append(budget - size)
    return bins


def completion_lengths(completion_mask: Tensor) -> list[int]:
    """Each row's completion length (its mask is a prefix: tokens, then padding)."""
    return completion_mask.long().sum(1).tolist()


def packed_token_count(lengths: list[int], budget: int) -> tuple[int, int]:
    """``(padded, packed)`` token counts of a micro-batch: rows × longest, and bins × longest bin."""
    bins = plan_bins(lengths, budget)
    longest_bin = max((sum(lengths[i] for i in b) for b in bins), default=0)
    return len(lengths) * max(lengths, default=0), len(bins) * longest_bin


AUTO_SAVING = 0.25
"""``pack_tokens: auto`` packs a micro-batch when its bins hold at most 1 − this of its padded tokens."""


def pack_budget(pack_tokens: int | str | None, completion_mask: Tensor) -> int | None:
    """The bin budget for a micro-batch: None = run it padded; 0 = bins as long as its longest sequence.

    ``pack_tokens``: None (never pack), a number of tokens per bin (always pack), or ``"auto"``: bins as long as
    the longest sequence, when they spare at least ``AUTO_SAVING`` of the padded tokens (short, even completions,
    like the quickstart's, stay padded: one bin per row would only add the layout's cost).
    """
    if pack_tokens is None:
        return None
    if pack_tokens != "auto":
        if type(pack_tokens) is not int or pack_tokens < 1:  # a bool is not a number of tokens
            raise ValueError(f"pack_tokens must be a number of tokens >= 1, 'auto' or None (got {pack_tokens!r})")
        return pack_tokens
    lengths = completion_lengths(completion_mask)
    padded, packed = packed_token_count(lengths, max(lengths, default=1))
    return 0 if packed <= (1 - AUTO_SAVING) * padded else None


class LeanPacking(NamedTuple):
    """The lean forward's packed layout of a micro-batch (see the module docstring).

    ``K`` distinct prompts of ``P`` positions, ``bins`` rows of ``L`` completion inputs, ``M`` prompt slots per bin.
    """

    index: Tensor  # [2, bins, L] (row, column) of the completion token at each packed position: the tokens that
    # predict the next one (a completion's last token predicts none); bin padding points at (0, 0), masked
    positions: Tensor  # [bins, L] their position ids: after their prompt's real tokens
    prompt_slots: Tensor  # [bins, M] the distinct prompt (an index into ``PromptGroups.first``) of each slot
    mask: Tensor  # [bins, 1, L, M * P + L] True = attend: own prompt's real tokens, own completion causally
    source: Tensor  # [tokens] per completion token (row-major): its state in cat(prompt last states, bins * L)


def lean_packing(prompt_mask: Tensor, completion_mask: Tensor, groups: PromptGroups, budget: int | None) -> LeanPacking:
    """The ``LeanPacking`` of a micro-batch; ``budget``: tokens per bin (None: the longest completion)."""
    lengths = completion_lengths(completion_mask)
    inputs_per_row = [max(n - 1, 0) for n in lengths]
    bins = plan_bins(inputs_per_row, max(budget or 0, max(inputs_per_row, default=0), 1))
    prompt_of = groups.inverse.tolist()
    prompt_lengths = prompt_mask.long().sum(1).tolist()
    width = prompt_mask.size(1)
    slots = [list(dict.fromkeys(prompt_of[i] for i in b)) for b in bins]
    num_slots = max((len(s) for s in slots), default=1)
    length = max((sum(inputs_per_row[i] for i in b) for b in bins), default=0)
    device = completion_mask.device
    positions = torch.zeros(len(bins), length, dtype=torch.long)
    mask = torch.zeros(len(bins), 1, length, num_slots * width + length, dtype=torch.bool)
    prompt_slots = torch.zeros(len(bins), num_slots, dtype=torch.long)
    rows, columns = torch.zeros(len(bins), length, dtype=torch.long), torch.zeros(len(bins), length, dtype=torch.long)
    where = {}  # row -> (bin, offset)
    prompt_real = prompt_mask.bool().cpu()
    for b, (members, bin_slots) in enumerate(zip(bins, slots)):
        prompt_slots[b, : len(bin_slots)] = torch.tensor(bin_slots)
        offset = 0
        for i in members:
            n, k = inputs_per_row[i], prompt_of[i]
            where[i] = (b, offset)
            span = slice(offset, offset + n)
            rows[b, span], columns[b, span] = i, torch.arange(n)
            positions[b, span] = prompt_lengths[i] + torch.arange(n)
            slot = bin_slots.index(k)
            mask[b, 0, span, slot * width : (slot + 1) * width] = prompt_real[i]
            keys = slice(num_slots * width + offset, num_slots * width + offset + n)
            mask[b, 0, span, keys] = torch.ones(n, n, dtype=torch.bool).tril()
            offset += n
        for q in range(offset, length):  # bin padding attends to itself only (a query with no key gives NaN)
            mask[b, 0, q, num_slots * width + q] = True
    num_prompts = groups.first.numel()
    source = []
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        source.append(prompt_of[i])  # the first completion token: predicted by the prompt's last state
        if n > 1:
            b, offset = where[i]
            source.extend(range(num_prompts + b * length + offset, num_prompts + b * length + offset + n - 1))
    return LeanPacking(
        index=torch.stack([rows, columns]).to(device),
        positions=positions.to(device),
        prompt_slots=prompt_slots.to(device),
        mask=mask.to(device),
        source=torch.tensor(source, dtype=torch.long, device=device),
    )


def lean_packed_hidden(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    groups: PromptGroups,
    packing: LeanPacking,
) -> Tensor:
    """``[tokens, H]``: the final-normed states that predict each completion token (row-major order), packed.

    The same values as ``shared_prompt_hidden`` at the completion tokens (a token sees exactly the keys it sees
    there), computed on ``bins × L`` positions instead of ``rows × T``.
    """
    first, _, padded = groups
    prompt_hidden, keys, values = run_prompts(model, prompt_ids[first], prompt_mask[first], padded)
    states = prompt_hidden[:, -1]
    bins, length = packing.positions.shape
    if length > 0:
        rows, columns = packing.index
        inputs = completion_ids[rows, columns]
        slots = packing.prompt_slots.flatten()
        num_slots = packing.prompt_slots.size(1)

        def prompt_keys(x: Tensor) -> Tensor:  # [K, heads, P, D] -> [bins, heads, M * P, D]
            per_slot = _repeat_rows(x, slots)
            heads, width, dim = per_slot.shape[1:]
            return per_slot.view(bins, num_slots, heads, width, dim).transpose(1, 2).reshape(bins, heads, -1, dim)

        def attend(layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
            return torch.cat([prompt_keys(keys[layer]), k], dim=2), torch.cat([prompt_keys(values[layer]), v], dim=2)

        hidden = decoder_hidden(model, inputs, packing.positions, packing.mask, attend)
        states = torch.cat([states, hidden.flatten(0, 1)])
    return final_norm(model, _repeat_rows(states, packing.source))


class FullPacking(NamedTuple):
    """The model's own forward, packed: prompt and completion tokens of each sequence, positions restarting."""

    input_ids: Tensor  # [bins, L]
    position_ids: Tensor  # [bins, L]
    source: Tensor  # [tokens] per completion token (row-major): the flat index in [bins * L] of its predicting state


def full_packing(
    prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor, budget: int | None
) -> FullPacking:
    """The ``FullPacking`` of a micro-batch of left-padded prompts; ``budget``: tokens per bin (None: the longest
    sequence). Bin padding continues with its own restarting positions (a sequence of its own)."""
    lengths = completion_lengths(completion_mask)
    prompt_lengths = prompt_mask.long().sum(1).tolist()
    sizes = [p + max(n - 1, 0) for p, n in zip(prompt_lengths, lengths)]
    bins = plan_bins(sizes, max(budget or 0, max(sizes, default=0), 1))
    length = max(sum(sizes[i] for i in b) for b in bins)
    width = prompt_ids.size(1)
    prompt_cpu, completion_cpu = prompt_ids.cpu(), completion_ids.cpu()
    input_ids = torch.zeros(len(bins), length, dtype=torch.long)
    position_ids = torch.zeros(len(bins), length, dtype=torch.long)
    start = {}
    for b, members in enumerate(bins):
        offset = 0
        for i in members:
            p, n = prompt_lengths[i], max(lengths[i] - 1, 0)
            tokens = torch.cat([prompt_cpu[i, width - p :], completion_cpu[i, :n]])
            input_ids[b, offset : offset + p + n] = tokens
            position_ids[b, offset : offset + p + n] = torch.arange(p + n)
            start[i] = b * length + offset
            offset += p + n
        position_ids[b, offset:] = torch.arange(length - offset)
    source = [start[i] + prompt_lengths[i] - 1 + t for i, n in enumerate(lengths) for t in range(n)]
    device = completion_ids.device
    return FullPacking(input_ids.to(device), position_ids.to(device), torch.tensor(source, device=device))


_ISOLATES: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


@torch.no_grad()
def packing_isolates(model: nn.Module) -> bool:
    """Whether ``model``'s own forward keeps packed sequences apart (position ids restarting, no attention mask):
    the logits of a sequence packed after another equal its logits alone. Probed once per model, in eval mode."""
    if model in _ISOLATES:
        return _ISOLATES[model]
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 2) or 2)
    device = next(model.parameters()).device
    first, second = torch.arange(1, 4) % vocab, torch.arange(5, 9) % vocab
    packed = torch.cat([first, second])[None].to(device)
    positions = torch.cat([torch.arange(3), torch.arange(4)])[None].to(device)
    was_training = model.training
    model.eval()
    try:
        together = model(input_ids=packed, position_ids=positions, use_cache=False).logits[0, 3:].float()
        alone = model(input_ids=second[None].to(device), use_cache=False).logits[0].float()
    finally:
        model.train(was_training)
    scale = alone.abs().max().clamp(min=1.0)
    isolates = bool(((together - alone).abs().max() / scale) < 1e-2)
    if not isolates:
        implementation = getattr(getattr(model, "config", None), "_attn_implementation", "?")
        log.warning(
            "packing: %s's attention (%s) mixes packed sequences; its log-prob passes use padded batches",
            type(model).__name__,
            implementation,
        )
    _ISOLATES[model] = isolates
    return isolates
