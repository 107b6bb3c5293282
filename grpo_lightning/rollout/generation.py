"""Sampling completions from a causal LM, and the log-probabilities of sampled tokens.

A lean loop instead of ``generate()``: each prompt is prefilled once and its KV cache shared by the G samples of
its group; each decoding step computes logits for the last position only; the loop stops as soon as every
sequence has ended. Prompts are left-padded, so position ids are derived from the attention mask.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

# Log-probs live in logprobs.py (chunked, bounded memory); imported here for the callers that expect them here.
from grpo_lightning.rollout.logprobs import (  # noqa: F401
    DEFAULT_LOGPROB_CHUNK,
    completion_logprobs,
    output_layer,
    token_logprobs,
)


@dataclass
class Completions:
    """Sampled completions, one row per (prompt, sample); rows of the same prompt are adjacent."""

    prompt_ids: Tensor  # [N, P] left-padded
    prompt_mask: Tensor  # [N, P]
    completion_ids: Tensor  # [N, T] right-padded with pad_token_id
    completion_mask: Tensor  # [N, T] 1 for generated tokens up to and including EOS
    truncated: Tensor  # [N] bool: ended by the length limit, not by EOS


def filter_logits(logits: Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Temperature, then top-k, then top-p (nucleus) filtering; removed tokens get -inf."""
    logits = logits / temperature
    if 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass; the first always stays.
        drop_sorted = probs.cumsum(-1) - probs >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(
    logits: Tensor,
    *,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """One token per row from ``logits`` ``[B, V]``."""
    if greedy:
        return logits.argmax(-1)
    probs = filter_logits(logits.float(), temperature=temperature, top_k=top_k, top_p=top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _cache_kwarg(model: PreTrainedModel) -> str:
    # transformers 5 renamed ``past_key_values`` to ``cache`` in the forward signature. A PEFT wrapper keeps the old
    # name in its own signature and passes either through: ask the model it wraps.
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


@torch.no_grad()
def sample_completions(
    model: PreTrainedModel,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    *,
    group_size: int,
    max_new_tokens: int,
    eos_token_id: int,
    pad_token_id: int,
    min_new_tokens: int = 0,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> Completions:
    """Sample ``group_size`` completions for each left-padded prompt in ``prompt_ids`` ``[B, P]``."""
    cache_kwarg = _cache_kwarg(model)
    num_prompts, device = prompt_ids.size(0), prompt_ids.device
    positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **{cache_kwarg: cache},
    )
    # The prompt is prefilled once; its cache is then repeated for the G samples of its group.
    cache.batch_repeat_interleave(group_size)
    logits = out.logits[:, -1].repeat_interleave(group_size, dim=0)
    attention = prompt_mask.repeat_interleave(group_size, dim=0)
    next_position = positions[:, -1:].repeat_interleave(group_size, dim=0) + 1
    n = num_prompts * group_size

    tokens = torch.full((n, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    finished = torch.zeros(n, dtype=torch.bool, device=device)
    lengths = torch.full((n,), max_new_tokens, dtype=torch.long, device=device)
    for step in range(max_new_tokens):
        if step < min_new_tokens:
            logits[:, eos_token_id] = float("-inf")
        token = sample_next(
            logits, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
        )
        token = token.masked_fill(finished, pad_token_id)
        tokens[:, step] = token
        just_ended = ~finished & (token == eos_token_id)
        lengths = torch.where(just_ended, step + 1, lengths)
        finished |= just_ended
        if step + 1 == max_new_tokens or bool(finished.all()):
            break
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
        out = model(
            input_ids=token[:, None],
            attention_mask=attention,
            position_ids=next_position,
            use_cache=True,
            **{cache_kwarg: cache},
        )
        logits = out.logits[:, -1]
        next_position = next_position + 1

    completion_len = int(lengths.max()) if bool(finished.all()) else max_new_tokens
    tokens = tokens[:, :completion_len]
    completion_mask = (torch.arange(completion_len, device=device)[None, :] < lengths[:, None]).long()
    return Completions(
        prompt_ids=prompt_ids.repeat_interleave(group_size, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(group_size, dim=0),
        completion_ids=tokens,
        completion_mask=completion_mask,
        truncated=~finished,
    )
