"""Model-based rewards: a sequence-classification reward model, and an LLM judge asked a rubric question.

Both load their model once per ``(model_name_or_path, device, dtype)`` and keep it (``clear_model_cache`` frees
them), run in batches of ``batch_size`` under ``torch.inference_mode()`` in eval mode with gradients switched off,
and are never trained.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Literal

import torch

from grpo_lightning.config import ConfigError
from grpo_lightning.rewards import register
from grpo_lightning.rewards.inputs import Completion, completion_texts, is_conversation, prompt_text

DEFAULT_RUBRIC = (
    "You are grading an answer.\n\nQuestion:\n{prompt}\n\nAnswer:\n{completion}\n\n"
    "How good is the answer, from {low} (useless) to {high} (perfect)? Reply with the number only.\nScore:"
)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@functools.lru_cache(maxsize=4)
def _load(kind: str, path: str, device: str, dtype: str | None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for a sequence classifier (``kind="classifier"``) or a causal LM, frozen."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from grpo_lightning.models.sources import missing_model_files

    missing = missing_model_files(Path(path)) if Path(path).is_dir() else None
    if missing:  # a half-copied folder: one line, not transformers' traceback (or random weights)
        raise ConfigError(f"data.rewards: the {kind} folder {path!r} {missing}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    auto = AutoModelForSequenceClassification if kind == "classifier" else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=getattr(torch, dtype) if dtype else None)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.to(device).eval().requires_grad_(False)
    return model, tokenizer


def clear_model_cache() -> None:
    """Forget every loaded reward model and judge."""
    _load.cache_clear()


def _chat(tokenizer: Any, messages: list[dict[str, str]], fallback: str, generation_prompt: bool) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return fallback


def _batches(items: list[str], size: int) -> list[list[str]]:
    if size < 1:
        raise ValueError(f"batch_size must be at least 1 (got {size})")
    return [items[i : i + size] for i in range(0, len(items), size)]


def _encode(tokenizer: Any, texts: list[str], max_length: int, device: str) -> Any:
    # A chat template writes its own special tokens (BOS...); plain text gets the tokenizer's.
    special = not getattr(tokenizer, "chat_template", None)
    kwargs = {"padding": True, "truncation": True, "max_length": max_length, "add_special_tokens": special}
    return tokenizer(texts, return_tensors="pt", **kwargs).to(device)


@register("reward_model")
def reward_model(
    prompts: list[Any],
    completions: list[Completion],
    *,
    model_name_or_path: str,
    batch_size: int = 8,
    device: str = "cpu",
    dtype: str | None = None,
    max_length: int = 1024,
    label_index: int = 0,
    normalize: Literal["none", "sigmoid"] = "none",
    **_: object,
) -> list[float]:
    """Score of prompt + completion from an ``AutoModelForSequenceClassification`` reward model.

    The pair is rendered with the tokenizer's chat template (user = prompt, assistant = completion) when it has
    one, else concatenated. Inputs longer than ``max_length`` tokens lose their beginning. The reward is logit
    ``label_index``, passed through a sigmoid with ``normalize="sigmoid"``.
    """
    completions = completion_texts(completions)  # a conversation's completions are message lists
    model, tokenizer = _load("classifier", model_name_or_path, device, dtype)
    texts = []
    for p, c in zip(prompts, completions, strict=True):
        # A conversation's own messages (system prompt included), else the prompt as the user turn.
        messages = list(p) if is_conversation(p) else [{"role": "user", "content": p}]
        texts.append(_chat(tokenizer, [*messages, {"role": "assistant", "content": c}], prompt_text(p) + c, False))
    tokenizer.truncation_side = "left"
    scores: list[float] = []
    with torch.inference_mode():
        for chunk in _batches(texts, batch_size):
            inputs = _encode(tokenizer, chunk, max_length, device)
            logits = model(**inputs).logits[:, label_index].float()
            scores.extend((logits.sigmoid() if normalize == "sigmoid" else logits).tolist())
    return scores


@register("llm_judge")
def llm_judge(
    prompts: list[Any],
    completions: list[Completion],
    *,
    model_name_or_path: str,
    rubric: str = DEFAULT_RUBRIC,
    scale: tuple[float, float] = (0, 9),
    method: Literal["generate", "expected"] = "expected",
    batch_size: int = 4,
    device: str = "cpu",
    dtype: str | None = None,
    max_new_tokens: int = 8,
    max_length: int = 2048,
    unparsable: float | None = 0.0,
    answer: list | None = None,
    **_: object,
) -> list[float | None]:
    """A causal LM's grade of each completion, mapped from ``scale`` to ``[0, 1]``.

    ``rubric`` is formatted with ``{prompt}``, ``{completion}``, ``{answer}`` (the reference column, when the
    dataset has one), ``{low}`` and ``{high}``, and sent as the user turn of the judge's chat template when it has
    one. ``method="generate"`` decodes up to ``max_new_tokens`` greedily and parses the first number (clamped to
    ``scale``; ``unparsable`` when there is none). ``method="expected"`` needs a scale of single-digit integers
    (e.g. 0-9 or 1-5) and reads the next-token probabilities of the digits: the reward is their expected value.
    """
    completions = completion_texts(completions)  # a conversation's completions are message lists
    low, high = scale
    if high <= low:
        raise ValueError(f"llm_judge scale must be (low, high) with low < high (got {scale})")
    model, tokenizer = _load("causal", model_name_or_path, device, dtype)
    refs = answer if answer is not None else [""] * len(prompts)
    texts = []
    for p, c, a in zip(prompts, completions, refs, strict=True):
        question = rubric.format(prompt=prompt_text(p), completion=c, answer=a, low=low, high=high)
        texts.append(_chat(tokenizer, [{"role": "user", "content": question}], question, True))
    tokenizer.padding_side, tokenizer.truncation_side = "left", "left"
    if method == "expected":
        digits = [str(d) for d in range(int(low), int(high) + 1)]
        ids = [tokenizer.convert_tokens_to_ids(d) for d in digits]
        if len(digits) > 10 or low != int(low) or high != int(high) or tokenizer.unk_token_id in ids:
            raise ValueError("llm_judge method='expected' needs an integer scale of single-digit tokens, e.g. (0, 9)")
        values = torch.tensor([float(d) for d in digits])
    elif method != "generate":
        raise ValueError(f"llm_judge method must be 'generate' or 'expected' (got {method!r})")
    scores: list[float | None] = []
    with torch.inference_mode():
        for chunk in _batches(texts, batch_size):
            inputs = _encode(tokenizer, chunk, max_length, device)
            if method == "expected":
                last = model(**inputs).logits[:, -1, :].float()
                probs = last[:, ids].softmax(-1).cpu()
                grades: list[float | None] = (probs @ values).tolist()
            else:
                out = model.generate(
                    **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
                )
                replies = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
                grades = []
                for reply in replies:
                    match = _NUMBER.search(reply)
                    grades.append(min(max(float(match.group(0)), low), high) if match else None)
            for grade in grades:
                scores.append(unparsable if grade is None else (grade - low) / (high - low))
    return scores
