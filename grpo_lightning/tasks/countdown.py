"""Countdown: reach a target with given numbers and + - * /; a synthetic task made locally from a seed.

Its reward, ``countdown``, lives with the other rewards (``grpo_lightning.rewards.countdown``), so that the reward
registry never imports a task; it is re-exported here.
"""

from __future__ import annotations

import random
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from grpo_lightning.rewards.countdown import countdown_reward, evaluate_expression, extract_expression
from grpo_lightning.tasks import register_task

if TYPE_CHECKING:  # datasets is imported when the task is built, so that the reward stays cheap to import
    from datasets import DatasetDict

__all__ = ["COUNTDOWN_TEMPLATE", "countdown", "countdown_reward", "evaluate_expression", "extract_expression"]

COUNTDOWN_TEMPLATE = (
    "Using the numbers {numbers}, write an arithmetic expression that equals {target}. You may use + - * / and "
    "parentheses, and each number at most once. Think inside <think> </think> tags, then write only the expression "
    "inside <answer> </answer> tags, like <answer> (3 + 5) * 2 </answer>."
)


def _make_problem(rng: random.Random, count: int, max_number: int, max_target: int) -> tuple[list[int], int, str]:
    """Numbers, a reachable positive integer target and one expression that reaches it (every number once)."""
    while True:
        numbers = [rng.randint(1, max_number) for _ in range(count)]
        terms = [(Fraction(n), str(n)) for n in numbers]
        rng.shuffle(terms)
        value, text = terms[0]
        for number, number_text in terms[1:]:
            op = rng.choice("+-*/")
            if op == "/" and (number == 0 or (value / number).denominator != 1):
                op = "+"
            value = {"+": value + number, "-": value - number, "*": value * number, "/": value / number}[op]
            text = f"({text} {op} {number_text})"
        if value.denominator == 1 and 0 < value <= max_target:
            return numbers, int(value), text[1:-1] if text.startswith("(") else text


@register_task("countdown")
def countdown(
    num_numbers: int = 4,
    max_number: int = 100,
    max_target: int = 1000,
    train_size: int = 10_000,
    test_size: int = 500,
    seed: int = 1234,
    template: str = COUNTDOWN_TEMPLATE,
) -> DatasetDict:
    """Countdown problems with columns ``prompt``, ``answer`` (the target), ``numbers``, ``target`` and ``solution``
    (one expression that reaches the target); train and test problems are distinct."""
    from datasets import Dataset, DatasetDict

    if num_numbers < 2 or max_number < 1:
        raise ValueError("countdown needs num_numbers >= 2 and max_number >= 1")
    rng = random.Random(seed)
    seen: set[tuple[tuple[int, ...], int]] = set()
    rows: list[dict[str, Any]] = []
    for _ in range(100 * (train_size + test_size)):
        if len(rows) == train_size + test_size:
            break
        numbers, goal, solution = _make_problem(rng, num_numbers, max_number, max_target)
        key = (tuple(sorted(numbers)), goal)
        if key in seen:
            continue
        seen.add(key)
        prompt = template.format(numbers=", ".join(map(str, numbers)), target=goal)
        rows.append({"prompt": prompt, "answer": str(goal), "numbers": numbers, "target": goal, "solution": solution})
    if len(rows) < train_size + test_size:
        raise ValueError("countdown could not make that many distinct problems; raise max_number or num_numbers")

    def table(part: list[dict[str, Any]]) -> Dataset:
        return Dataset.from_dict({key: [row[key] for row in part] for key in rows[0]})

    return DatasetDict({"test": table(rows[:test_size]), "train": table(rows[test_size:])})
