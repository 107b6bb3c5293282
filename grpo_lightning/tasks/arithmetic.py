"""Arithmetic: ``a+b=`` → ``a+b``, for two-digit operands. The offline default task.

All ``max_operand+1`` squared ordered pairs are split once, by a fixed seed, into disjoint train and test sets, so
the held-out prompts never appear in training whatever the run's own seed.
"""

from __future__ import annotations

import random

from datasets import Dataset, DatasetDict

from grpo_lightning.tasks import register_task


def addition_pairs(max_operand: int = 99, test_size: int = 500, split_seed: int = 1234) -> dict[str, list]:
    """Disjoint ``train`` / ``test`` lists of ``(a, b)`` with ``0 ≤ a, b ≤ max_operand``."""
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    if not 0 < test_size < len(pairs):
        raise ValueError(f"test_size must be between 1 and {len(pairs) - 1} (got {test_size})")
    random.Random(split_seed).shuffle(pairs)
    return {"test": pairs[:test_size], "train": pairs[test_size:]}


def format_prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


@register_task("arithmetic")
def arithmetic(max_operand: int = 99, test_size: int = 500, split_seed: int = 1234) -> DatasetDict:
    """Addition of two numbers in ``[0, max_operand]``; columns ``prompt`` and ``answer``."""
    splits = addition_pairs(max_operand, test_size, split_seed)
    return DatasetDict(
        {
            name: Dataset.from_dict(
                {"prompt": [format_prompt(a, b) for a, b in pairs], "answer": [str(a + b) for a, b in pairs]}
            )
            for name, pairs in splits.items()
        }
    )
