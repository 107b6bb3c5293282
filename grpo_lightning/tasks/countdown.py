"""Countdown: reach a target with given numbers and + - * /; a synthetic task made locally from a seed.

Also registers the ``countdown`` reward, which checks the expression in the completion's ``<answer>`` tags with
an ``ast``-based evaluator (never ``eval``): only non-negative integer literals, the four binary operators and
parentheses are accepted, each given number at most once (or exactly once with ``use_all=True``).
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from grpo_lightning.rewards import register
from grpo_lightning.rewards.math import last_boxed
from grpo_lightning.tasks import register_task

if TYPE_CHECKING:  # datasets is imported when the task is built, so that the reward stays cheap to import
    from datasets import DatasetDict

COUNTDOWN_TEMPLATE = (
    "Using the numbers {numbers}, write an arithmetic expression that equals {target}. You may use + - * / and "
    "parentheses, and each number at most once. Think inside <think> </think> tags, then write only the expression "
    "inside <answer> </answer> tags, like <answer> (3 + 5) * 2 </answer>."
)
_OPS = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__, ast.Div: Fraction.__truediv__}
_MAX_EXPRESSION_CHARS = 200


def evaluate_expression(expression: str) -> tuple[Fraction, list[int]] | None:
    """``(value, numbers used)`` of an expression of non-negative integers, + - * / and parentheses; None for
    anything else (other syntax, division by zero, overly long input)."""
    if len(expression) > _MAX_EXPRESSION_CHARS:
        return None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    used: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ZeroDivisionError
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0:
            used.append(node.value)
            return Fraction(node.value)
        raise ValueError(f"not allowed in a countdown expression: {type(node).__name__}")

    try:
        return walk(tree.body), used
    except (ValueError, ZeroDivisionError, RecursionError):
        return None


def extract_expression(completion: str) -> str | None:
    """The expression in the last ``<answer>…</answer>`` (or ``\\boxed{}``), without a trailing ``= target``."""
    tags = re.findall(r"<answer>(.*?)</answer>", completion, re.DOTALL)
    text = tags[-1] if tags else last_boxed(completion)
    if text is None:
        return None
    text = text.replace("×", "*").replace("÷", "/").replace("\\times", "*").replace("\\div", "/").strip()
    return text.split("=")[0].strip() if "=" in text else text


@register("countdown")
def countdown_reward(
    prompts: list[str],
    completions: list[str],
    numbers: list[list[int]],
    answer: list | None = None,
    target: list | None = None,
    *,
    use_all: bool = False,
    format_score: float = 0.0,
    **_: object,
) -> list[float | None]:
    """1.0 when the completion's expression uses only the row's ``numbers`` (each at most once, or exactly once
    with ``use_all``) and equals the target (the ``target`` column, else ``answer``); ``format_score`` for a valid
    expression with the wrong value or numbers; 0.0 otherwise. Rows without numbers give None.
    """
    targets = target if target is not None else answer
    if targets is None:
        raise ValueError("the countdown reward needs a 'target' or 'answer' column")
    scores: list[float | None] = []
    for completion, given, goal in zip(completions, numbers, targets, strict=True):
        if given is None or goal is None:
            scores.append(None)
            continue
        expression = extract_expression(completion)
        evaluated = evaluate_expression(expression) if expression else None
        if evaluated is None:
            scores.append(0.0)
            continue
        value, used = evaluated
        available, spent = Counter(int(n) for n in given), Counter(used)
        allowed = spent == available if use_all else not spent - available
        scores.append(1.0 if allowed and value == Fraction(str(goal).strip()) else format_score)
    return scores


countdown_reward.required_columns = ("numbers", "answer")


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
