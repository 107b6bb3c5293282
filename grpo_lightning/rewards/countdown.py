"""The ``countdown`` reward: the expression in the completion's ``<answer>`` tags must reach the target.

An ``ast``-based evaluator (never ``eval``): only non-negative integer literals, the four binary operators and
parentheses are accepted, each given number at most once (or exactly once with ``use_all=True``). The task that
makes the problems is ``grpo_lightning.tasks.countdown``.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction

from grpo_lightning.rewards import register
from grpo_lightning.rewards.inputs import Completion, completion_texts
from grpo_lightning.rewards.math import last_boxed

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
    completions: list[Completion],
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
    completions = completion_texts(completions)  # a conversation's completions are message lists
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
