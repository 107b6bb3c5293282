"""Multiplication of 3–4 digit numbers (``a*b=`` → ``a*b``): beyond a tiny model's head, easy with a calculator.

The task of the tool-calling demo (``configs/tools_calculator.yaml``). Pairs are drawn once by a fixed seed and
split into disjoint train and test sets, so the held-out prompts never appear in training.
"""

from __future__ import annotations

import random

from datasets import Dataset, DatasetDict

from grpo_lightning.tasks import register_task


def multiplication_pairs(
    low: int = 100, high: int = 9999, train_size: int = 20000, test_size: int = 500, split_seed: int = 4321
) -> dict[str, list[tuple[int, int]]]:
    """Disjoint ``train`` / ``test`` lists of distinct ``(a, b)`` with ``low ≤ a, b ≤ high``."""
    if not 0 < low <= high:
        raise ValueError(f"need 0 < low <= high (got low={low}, high={high})")
    rng = random.Random(split_seed)
    pairs: dict[tuple[int, int], None] = {}
    while len(pairs) < train_size + test_size:
        pairs[(rng.randint(low, high), rng.randint(low, high))] = None
    ordered = list(pairs)
    return {"test": ordered[:test_size], "train": ordered[test_size:]}


def format_prompt(a: int, b: int) -> str:
    return f"{a}*{b}="


@register_task("multiplication")
def multiplication(
    low: int = 100, high: int = 9999, train_size: int = 20000, test_size: int = 500, split_seed: int = 4321
) -> DatasetDict:
    """Products of two numbers in ``[low, high]``; columns ``prompt`` and ``answer``."""
    splits = multiplication_pairs(low, high, train_size, test_size, split_seed)
    return DatasetDict(
        {
            name: Dataset.from_dict(
                {"prompt": [format_prompt(a, b) for a, b in pairs], "answer": [str(a * b) for a, b in pairs]}
            )
            for name, pairs in splits.items()
        }
    )
