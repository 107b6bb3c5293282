"""Shape rewards: the R1 ``<think>…</think><answer>…</answer>`` layout, and DAPO's soft overlong punishment.

``overlong_penalty`` measures length in tokens when it can (a ``completion_lengths`` column with token counts, or
a ``tokenizer`` to count with) and in characters otherwise; the values it returns say nothing about which, so set
``max_length`` / ``buffer`` in the same unit as the length it will see.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Literal

from grpo_lightning.rewards import register
from grpo_lightning.rewards.inputs import Completion, completion_texts

_STRICT = re.compile(r"<think>\n?(?P<think>.*?)\n?</think>\s*<answer>\n?(?P<answer>.*?)\n?</answer>", re.DOTALL)
_LENIENT = re.compile(r"<think>(?P<think>.*?)</think>.*?<answer>(?P<answer>.*?)</answer>", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def r1_format_ok(completion: str, mode: Literal["strict", "lenient"] = "strict", think_in_prompt: bool = False) -> bool:
    """Whether ``completion`` follows the R1 layout.

    ``strict``: the whole completion (outer whitespace aside) is one ``<think>`` block then one ``<answer>``
    block, only whitespace between them, each tag exactly once and both blocks non-empty. ``lenient``: a
    ``<think>…</think>`` block followed somewhere later by a non-empty ``<answer>…</answer>`` block, anything
    around them. ``think_in_prompt``: the prompt already ends with ``<think>``, so the completion starts inside it.
    """
    text = completion.strip()
    if think_in_prompt and not text.startswith("<think>"):
        text = "<think>" + text
    if mode == "strict":
        match = _STRICT.fullmatch(text)
        if not match or any(text.count(tag) != 1 for tag in _TAGS):
            return False
    elif mode == "lenient":
        match = _LENIENT.search(text)
        if not match:
            return False
    else:
        raise ValueError(f"format mode must be 'strict' or 'lenient' (got {mode!r})")
    return bool(match.group("think").strip()) and bool(match.group("answer").strip())


@register("format")
def r1_format(
    prompts: list[str],
    completions: list[Completion],
    *,
    mode: Literal["strict", "lenient"] = "strict",
    think_in_prompt: bool = False,
    reward: float = 1.0,
    **_: object,
) -> list[float]:
    """``reward`` when the completion follows the R1 ``<think>…</think><answer>…</answer>`` layout, else 0.0.

    ``mode`` and ``think_in_prompt`` are those of :func:`r1_format_ok`.
    """
    completions = completion_texts(completions)  # a conversation's completions are message lists
    return [reward if r1_format_ok(c, mode, think_in_prompt) else 0.0 for c in completions]


@functools.lru_cache(maxsize=4)
def _load_tokenizer(name_or_path: str):  # noqa: ANN202 - a transformers tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path)


def soft_overlong(length: float, max_length: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment for one length.

    0 up to ``max_length - buffer``; then linear down to ``-penalty`` at ``max_length``; ``-penalty`` beyond.
    """
    if buffer < 0 or buffer > max_length:
        raise ValueError(f"overlong_penalty needs 0 <= buffer <= max_length (got buffer={buffer}, {max_length=})")
    start = max_length - buffer
    if length <= start:
        return 0.0
    if length > max_length or buffer == 0:
        return -penalty
    return -penalty * (length - start) / buffer


@register("overlong_penalty")
def overlong_penalty(
    prompts: list[str],
    completions: list[Completion],
    *,
    max_length: int,
    buffer: int,
    penalty: float = 1.0,
    tokenizer: str | None = None,
    completion_lengths: Sequence[int] | None = None,
    **_: object,
) -> list[float]:
    """DAPO soft overlong punishment (:func:`soft_overlong`), a value in ``[-penalty, 0]``.

    Length of each completion: the ``completion_lengths`` column when the rollout passes one (token counts), else
    the token count from ``tokenizer`` (a name or path for ``AutoTokenizer``, loaded once), else characters.
    ``max_length`` should be the generation limit (``max_new_tokens``) and ``buffer`` the length of the
    punishment ramp, in the same unit.
    """
    completions = completion_texts(completions)  # a conversation's completions are message lists
    if completion_lengths is not None:
        lengths = [float(n) for n in completion_lengths]
    elif tokenizer is not None:
        tok = _load_tokenizer(tokenizer)
        lengths = [float(len(ids)) for ids in tok(list(completions), add_special_tokens=False)["input_ids"]]
    else:
        lengths = [float(len(c)) for c in completions]
    return [soft_overlong(n, max_length, buffer, penalty) for n in lengths]
