"""Exact-answer reward: the completion, stripped, equals the reference answer."""

from __future__ import annotations

from grpo_lightning.rewards import register
from grpo_lightning.rewards.inputs import Completion, completion_texts


@register("exact_answer")
def exact_answer(prompts: list[str], completions: list[Completion], answer: list, **_: object) -> list[float]:
    """1.0 when the completion (surrounding whitespace removed) equals ``answer`` exactly, else 0.0."""
    completions = completion_texts(completions)  # a conversation's completions are message lists
    return [float(completion.strip() == str(ref).strip()) for completion, ref in zip(completions, answer)]


exact_answer.required_columns = ("answer",)
exact_answer.settings = ()  # ``**_`` takes the columns, not settings: any ``kwargs`` key is a mistake
