"""Sampling completions from a causal LM, and the log-probabilities of sampled tokens.

A lean loop instead of ``generate()``: each prompt is prefilled once and its KV cache shared by the G samples of
its group; each decoding step computes logits for the last position only; the loop stops as soon as every
sequence has ended. Prompts are left-padded, so position ids are derived from the attention mask.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache, PreTrainedModel


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
    # transformers 5 renamed ``past_key_values`` to ``cache`` in the forward signature.
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


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


# Positions whose full-vocabulary logits exist at once when computing log-probs: 1024 × a 152k vocabulary in
# float32 is 0.6 GB, whatever the batch size and completion length.
DEFAULT_LOGPROB_CHUNK = 1024


def _chunk_logprobs(logits: Tensor, labels: Tensor, with_entropy: bool) -> Tensor:
    """``[M, 1 or 2]``: log p(label) (and the entropy) of ``M`` positions from their logits ``[M, V]``."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    columns = [logits.gather(-1, labels[:, None]).squeeze(-1) - lse]
    if with_entropy:
        # H = -Σ p log p = logsumexp(x) - Σ p x: one softmax instead of a log_softmax plus its exp.
        columns.append(lse - (torch.softmax(logits, dim=-1) * logits).sum(-1))
    return torch.stack(columns, dim=-1)


def _chunked(
    logits_of: Callable[[Tensor], Tensor], inputs: Tensor, labels: Tensor, with_entropy: bool, chunk_size: int
) -> Tensor:
    """``_chunk_logprobs`` over ``chunk_size`` rows of ``inputs`` at a time, ``logits_of`` mapping rows to logits.

    With autograd on, each chunk is recomputed in the backward pass (activation checkpointing), so only one
    chunk's logits are alive at any time, in the forward pass and in the backward pass alike.
    """
    out = []
    for start in range(0, inputs.size(0), chunk_size):
        x, y = inputs[start : start + chunk_size], labels[start : start + chunk_size]

        def chunk(x: Tensor, y: Tensor = y) -> Tensor:
            return _chunk_logprobs(logits_of(x), y, with_entropy)

        if torch.is_grad_enabled():
            out.append(checkpoint(chunk, x, use_reentrant=False, preserve_rng_state=False))
        else:
            out.append(chunk(x))
    width = 2 if with_entropy else 1
    return torch.cat(out) if out else inputs.new_zeros(0, width, dtype=torch.float32)


def token_logprobs(
    logits: Tensor, labels: Tensor, *, with_entropy: bool = False, chunk_size: int | None = DEFAULT_LOGPROB_CHUNK
) -> tuple[Tensor, Tensor | None]:
    """log p(label) per position from ``logits`` ``[B, T, V]``, and the entropy of each position when asked.

    Positions are processed ``chunk_size`` at a time (all at once when ``None``), so the float32 copy and the
    softmax exist for one chunk only instead of for the whole ``[B, T, V]`` batch.
    """
    shape = labels.shape
    flat_logits, flat_labels = logits.reshape(-1, logits.size(-1)), labels.reshape(-1)
    stats = _chunked(lambda x: x, flat_logits, flat_labels, with_entropy, chunk_size or max(1, flat_labels.numel()))
    logprobs = stats[:, 0].reshape(shape)
    return logprobs, (stats[:, 1].reshape(shape) if with_entropy else None)


def output_layer(model: PreTrainedModel) -> torch.nn.Module | None:
    """The layer mapping hidden states to logits, when log-probs can be computed from it chunk by chunk.

    None when the model post-processes its logits (Gemma's soft-capping) or when the layer's weights exist only
    inside DeepSpeed ZeRO-3's own hooks: log-probs then come from the model's full logits.
    """
    get = getattr(model, "get_output_embeddings", None)
    layer = get() if callable(get) else None
    config = getattr(model, "config", None)
    if layer is None or getattr(config, "final_logit_softcapping", None):
        return None
    if hasattr(getattr(layer, "weight", None), "ds_id"):
        return None
    return layer


@contextmanager
def _logprobs_as_logits(
    layer: torch.nn.Module, labels: Tensor, mask: Tensor, *, temperature: float, with_entropy: bool, chunk_size: int
) -> Iterator[dict[str, bool]]:
    """While active, ``layer`` returns ``[B, T + 1, 1 or 2]`` log-probs (and entropies) instead of logits.

    The model's forward runs unchanged up to its output layer; hooks on that layer take its input hidden states
    ``[B, T + 1, H]``, give it an empty slice to project, and replace its output with log-probs of the completion
    tokens computed ``chunk_size`` positions at a time (the last position predicts nothing and gets zeros, as do
    padding positions). Doing it inside the model's forward keeps sharding wrappers (FSDP2) and data-parallel
    gradient hooks (DDP) seeing an ordinary forward whose output feeds the loss.
    """
    state = {"fired": False}
    hidden: list[Tensor] = []

    def take_hidden(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden.append(args[0])
        return (args[0][:, :0], *args[1:])

    def logprobs_out(module: torch.nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor:
        states = hidden.pop()
        rows, positions = labels.shape
        picked = states[:, :positions][mask]  # real completion tokens only: padding costs nothing

        def logits_of(x: Tensor) -> Tensor:
            logits = module.forward(x)  # .forward: these calls must not re-enter the hooks
            return logits / temperature if temperature != 1.0 else logits

        stats = _chunked(logits_of, picked, labels[mask], with_entropy, chunk_size)
        out = stats.new_zeros(rows, positions + 1, stats.size(-1))
        out[:, :positions][mask] = stats
        state["fired"] = True
        return out

    handles = [layer.register_forward_pre_hook(take_hidden), layer.register_forward_hook(logprobs_out)]
    try:
        yield state
    finally:
        for handle in handles:
            handle.remove()


def completion_logprobs(
    model: PreTrainedModel,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    micro_batch_size: int | None = None,
    with_entropy: bool = False,
    chunk_size: int | None = DEFAULT_LOGPROB_CHUNK,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs ``[N, T]`` of the completion tokens (and entropies), in micro-batches of rows.

    Logits are computed for the completion positions only, divided by the sampling temperature so that the
    log-probs are those of the distribution the tokens were drawn from. With ``chunk_size``, the output layer
    projects ``chunk_size`` completion tokens at a time, so peak memory does not grow with rows × length ×
    vocabulary (and the backward pass recomputes each chunk's logits instead of keeping them all). Padding
    positions (``completion_mask == 0``) get log-prob 0 on that path. ``chunk_size=None`` keeps the plain path:
    full logits from the model, then log-probs.
    """
    num_rows, completion_len = completion_ids.shape
    step = micro_batch_size or num_rows
    layer = output_layer(model) if chunk_size else None
    logprobs, entropies = [], []
    for start in range(0, num_rows, step):
        rows = slice(start, start + step)
        input_ids = torch.cat([prompt_ids[rows], completion_ids[rows]], dim=1)
        attention = torch.cat([prompt_mask[rows], completion_mask[rows]], dim=1)
        positions = (attention.long().cumsum(-1) - 1).clamp(min=0)
        inputs = {"input_ids": input_ids, "attention_mask": attention, "position_ids": positions}
        # use_cache=False: a training forward has no use for a KV cache, and building one costs memory.
        inputs.update(logits_to_keep=completion_len + 1, use_cache=False)
        hooks = (
            _logprobs_as_logits(
                layer,
                completion_ids[rows],
                completion_mask[rows].bool(),
                temperature=temperature,
                with_entropy=with_entropy,
                chunk_size=chunk_size,
            )
            if layer is not None
            else nullcontext({"fired": False})
        )
        with hooks as state:
            output = model(**inputs).logits[:, :-1]
        if state["fired"]:
            chunk_logprobs = output[..., 0]
            chunk_entropy = output[..., 1] if with_entropy else None
        else:  # no usable output layer (or the model bypassed it): the model returned full logits
            if temperature != 1.0:
                output = output / temperature
            chunk_logprobs, chunk_entropy = token_logprobs(
                output, completion_ids[rows], with_entropy=with_entropy, chunk_size=chunk_size
            )
        logprobs.append(chunk_logprobs)
        entropies.append(chunk_entropy)
    return torch.cat(logprobs), (torch.cat(entropies) if with_entropy else None)
