"""Where the steps of a completion end, in token positions (for process rewards)."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase


def step_token_ends(
    texts: list[str],
    completion_ids: Tensor,
    completion_mask: Tensor,
    tokenizer: PreTrainedTokenizerBase,
    separator: str,
) -> Tensor:
    """``[N, S]`` token index at which each step of each completion ends (-1 pads rows with fewer steps).

    A step ends at the token holding its last character; the last step ends at the last completion token (the
    EOS, when there is one), so every token belongs to some step. Character positions are mapped to tokens by
    decoding each token on its own, which is exact for character- and byte-level tokenizers.
    """
    ends: list[list[int]] = []
    for text, ids, mask in zip(texts, completion_ids.tolist(), completion_mask.tolist()):
        length = sum(mask)
        char_ends, position = [], 0  # char_ends[t]: characters decoded up to and including token t
        for token in ids[:length]:
            position += len(tokenizer.decode([token], skip_special_tokens=True))
            char_ends.append(position)
        pieces = text.split(separator)
        row, offset = [], 0
        for k, piece in enumerate(pieces):
            offset += len(piece)
            if k == len(pieces) - 1:
                row.append(max(length - 1, 0))
            else:
                row.append(next((t for t, end in enumerate(char_ends) if end >= offset), max(length - 1, 0)))
                offset += len(separator)
        ends.append(row)
    width = max(len(row) for row in ends)
    return torch.tensor([row + [-1] * (width - len(row)) for row in ends], dtype=torch.long)
