"""``integrations/environments/turn_tokens.py``: a turn's observations tokenized in one call give each observation's own
ids (cut to ``max_observation_tokens`` with one warning per environment class), and the padded tensors equal row-by-row
padding, for empty rows, one row and a round's 256."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_stop_texts import TOKENIZERS

from grpo_lightning.integrations.environments import ToolEnvironment, turn_tokens
from grpo_lightning.integrations.environments.turn_tokens import (
    left_padded,
    observation_ids,
    observations_ids,
    right_padded,
)


def rows_of(rng: random.Random, count: int, empty: bool = True) -> list[list[int]]:
    return [[rng.randrange(100) for _ in range(rng.randint(0 if empty else 1, 40))] for _ in range(count)]


@pytest.mark.parametrize("count", [1, 3, 256])
def test_padding_equals_padding_each_row(count):
    rng = random.Random(count)
    rows = rows_of(rng, count)
    width = max(len(r) for r in rows)
    ids, mask = left_padded(rows, 7, "cpu")
    assert ids.shape == mask.shape == (count, width) and ids.dtype == mask.dtype == torch.long
    for i, row in enumerate(rows):
        assert ids[i].tolist() == [7] * (width - len(row)) + row
        assert mask[i].tolist() == [0] * (width - len(row)) + [1] * len(row)
    floats = [[rng.uniform(-30.0, 0.0) for _ in row] for row in rows]
    for values, value, dtype in ((rows, -1, torch.long), (floats, 0.0, torch.float32)):
        padded = right_padded(values, value, dtype, "cpu")
        assert padded.shape == (count, max(width, 1)) and padded.dtype == dtype
        for i, row in enumerate(values):  # the same values as one tensor per row: float32 rounding included
            expected = torch.tensor(row, dtype=dtype)
            assert torch.equal(padded[i], F.pad(expected, (0, padded.size(1) - len(row)), value=value))


def test_empty_rows_pad_to_their_shapes():
    ids, mask = left_padded([[], []], 0, "cpu")
    assert ids.shape == mask.shape == (2, 0)
    assert right_padded([[], []], 0.0, torch.float32, "cpu").tolist() == [[0.0], [0.0]]


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_a_turns_observations_tokenize_as_each_on_its_own(name, monkeypatch):
    tokenizer = TOKENIZERS[name]()
    environment = ToolEnvironment(format="tag", max_observation_tokens=12)
    texts = ["<result>699678</result>", "<result>error: bad</result>", "x", "café 12€ </tool> é", "<|stop|> a"]
    texts += ["<result>" + "1" * 40 + "</result>"]  # over the limit
    monkeypatch.setattr(turn_tokens, "_WARNED_OVERSIZE", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batched = observations_ids(environment, texts * 3, tokenizer)
    one_by_one = [tokenizer(text, add_special_tokens=False)["input_ids"][:12] for text in texts * 3]
    assert batched == one_by_one and max(len(ids) for ids in batched) == 12
    assert [observation_ids(environment, text, tokenizer) for text in texts] == one_by_one[: len(texts)]
    oversize = [
        w for w in caught if issubclass(w.category, RuntimeWarning) and "max_observation_tokens" in str(w.message)
    ]
    assert len(oversize) == 1  # once per environment class
    assert observations_ids(environment, [], tokenizer) == []
