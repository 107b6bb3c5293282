"""Sampling completions from a causal LM, and the log-probabilities of sampled tokens.

A lean loop instead of ``generate()``: each prompt is prefilled once and its keys and values shared by the G
samples of its group; each decoding step computes logits for the last position only; the loop stops as soon as
every sequence has ended. Prompts are left-padded, so position ids are derived from the attention mask. The steps
run on ``grpo_lightning.models.lean`` when the model supports it, else on the model's own forward.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from grpo_lightning.models.lean import LeanDecoder, lean_unsupported, mask_positions

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
    # [N, T] log-probs of the drawn tokens under the sampling policy (temperature applied, before top-k/top-p),
    # 0 on padding; only with ``sample_completions(..., return_logprobs=True)``: π_old without another forward.
    logprobs: Tensor | None = None


# ``_cumsum_unit_``'s fixed point under deterministic algorithms off the CPU: steps of 2^-40, and a sum of up to
# 2^23 values in [0, 1] still fits in int64.
_FIXED_POINT = float(1 << 40)


def _cumsum_unit_(x: Tensor) -> Tensor:
    """``x.cumsum_(-1)`` of values in [0, 1], in place.

    Under ``torch.use_deterministic_algorithms`` (``trainer.deterministic``) off the CPU, where torch has no
    deterministic cumsum of floats and raises, the values are rounded to multiples of 2^-40 and summed exactly as
    int64 (in any order), so sampling and top-p work there too, bit for bit the same at every run.
    """
    if x.device.type == "cpu" or not torch.are_deterministic_algorithms_enabled():
        return x.cumsum_(-1)
    fixed = x.double().mul_(_FIXED_POINT).round_().long().cumsum_(-1)
    return x.copy_(fixed.double().div_(_FIXED_POINT))


def filter_logits(logits: Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Temperature, then top-k, then top-p (nucleus) filtering; removed tokens get -inf."""
    if temperature != 1.0:  # a full pass over [B, V] saved in the common case
        logits = logits / temperature
    if 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass; the first always stays.
        drop_sorted = _cumsum_unit_(probs.clone()) - probs >= top_p
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
    """One token per row from ``logits`` ``[B, V]``: the argmax when ``greedy``, else a draw from the filtered softmax.

    The draw inverts the cumulative distribution with one uniform number per row, which is exact and several times
    cheaper than ``torch.multinomial`` (that draws an exponential variate for every vocabulary entry).
    """
    if greedy:
        return logits.argmax(-1)
    logits = filter_logits(logits.float(), temperature=temperature, top_k=top_k, top_p=top_p)
    # Unnormalised probabilities: comparing against u × total mass is the same as normalising first. Filtered
    # tokens have zero mass, so the cumulative sum is flat there and they are never the first index reaching u.
    cdf = _cumsum_unit_((logits - logits.amax(-1, keepdim=True)).exp_())
    uniform = torch.rand(cdf.size(0), 1, device=cdf.device, generator=generator)
    threshold = (1.0 - uniform) * cdf[:, -1:]  # in (0, total]: never selects a token of zero mass at index 0
    return (cdf < threshold).sum(-1).clamp_(max=cdf.size(-1) - 1)


class _PreallocatedLayer(DynamicLayer):
    """A full-attention KV-cache layer that writes each new position into a buffer sized for the whole completion.

    ``DynamicLayer`` concatenates at every decoding step, copying the whole cache each time (traffic quadratic in
    the length, and two copies alive at once). This layer is built from a prefilled one, repeating each prompt's
    keys and values for the G samples of its group straight into the buffer, and then writes one position per step;
    attention reads a view of the filled part.
    """

    def __init__(self, prefilled: DynamicLayer, repeats: int, capacity: int) -> None:
        super().__init__()
        keys, values = prefilled.keys, prefilled.values
        rows, length = keys.size(0), keys.size(-2)
        self._keys = keys.new_empty(rows * repeats, keys.size(1), capacity, keys.size(-1))
        self._values = values.new_empty(rows * repeats, values.size(1), capacity, values.size(-1))
        for buffer, prefix in ((self._keys, keys), (self._values, values)):
            buffer.view(rows, repeats, *buffer.shape[1:])[..., :length, :] = prefix[:, None]
        self.device, self.is_initialized = keys.device, True
        self.keys, self.values = self._keys[..., :length, :], self._values[..., :length, :]

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: object, **kwargs: object
    ) -> tuple[Tensor, Tensor]:
        start = self.keys.size(-2)
        end = start + key_states.size(-2)
        self._keys[..., start:end, :] = key_states
        self._values[..., start:end, :] = value_states
        self.keys, self.values = self._keys[..., :end, :], self._values[..., :end, :]
        return self.keys, self.values


def _repeat_cache(cache: DynamicCache, repeats: int, capacity: int) -> None:
    """Repeat every prompt's cache ``repeats`` times, into preallocated buffers when all layers are plain ones."""
    layers = getattr(cache, "layers", None)
    # Sliding-window, linear-attention or quantized layers keep their own update rules: repeat them as they are.
    if layers and all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers):
        cache.layers = [_PreallocatedLayer(layer, repeats, capacity) for layer in layers]
    else:
        cache.batch_repeat_interleave(repeats)


def _cache_kwarg(model: PreTrainedModel) -> str:
    # transformers 5 renamed ``past_key_values`` to ``cache`` in the forward signature. A PEFT wrapper keeps the old
    # name in its own signature and passes either through: ask the model it wraps.
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


class _ModelDecoder:
    """Sampling steps on the model's own forward (any architecture): a ``DynamicCache`` prefilled once per prompt,
    then repeated for the G samples of its group into preallocated buffers."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model, self.cache_kwarg = model, _cache_kwarg(model)

    def prefill(self, prompt_ids: Tensor, prompt_mask: Tensor, group_size: int, max_new_tokens: int) -> Tensor:
        positions = mask_positions(prompt_mask)
        self.cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kwarg: self.cache},
        )
        _repeat_cache(self.cache, group_size, capacity=prompt_ids.size(1) + max_new_tokens)
        self.attention = prompt_mask.repeat_interleave(group_size, dim=0)
        self.positions = positions[:, -1:].repeat_interleave(group_size, dim=0)
        return out.logits[:, -1]

    def decode(self, tokens: Tensor) -> Tensor:
        self.attention = torch.cat([self.attention, torch.ones_like(self.attention[:, :1])], dim=1)
        self.positions = self.positions + 1
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=self.attention,
            position_ids=self.positions,
            use_cache=True,
            **{self.cache_kwarg: self.cache},
        )
        return out.logits[:, -1]


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
    return_logprobs: bool = False,
    lean: bool = True,
) -> Completions:
    """Sample ``group_size`` completions for each left-padded prompt in ``prompt_ids`` ``[B, P]``.

    With ``return_logprobs``, ``Completions.logprobs`` holds each drawn token's log-probability under the tempered
    distribution of the sampling policy, which is what GRPO's old-policy log-probs are when a round has several
    optimizer steps. With ``lean`` (and a model it supports, see ``grpo_lightning.models.lean``), the steps run on
    the lean forward.
    """
    decoder = LeanDecoder(model) if lean and lean_unsupported(model) is None else _ModelDecoder(model)
    device = prompt_ids.device
    # The prompt is prefilled once; its keys and values are then repeated for the G samples of its group.
    logits = decoder.prefill(prompt_ids, prompt_mask, group_size, max_new_tokens).repeat_interleave(group_size, dim=0)
    n = prompt_ids.size(0) * group_size

    tokens = torch.full((n, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    finished = torch.zeros(n, dtype=torch.bool, device=device)
    lengths = torch.full((n,), max_new_tokens, dtype=torch.long, device=device)
    logprobs = torch.zeros(n, max_new_tokens, device=device) if return_logprobs else None
    for step in range(max_new_tokens):
        if logprobs is not None:  # before the EOS ban: the training forward scores tokens without it
            scores = logits.float() / temperature if temperature != 1.0 else logits.float()
            all_logprobs = scores.log_softmax(-1)
        if step < min_new_tokens:
            logits[:, eos_token_id] = float("-inf")
        token = sample_next(
            logits, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
        )
        token = token.masked_fill(finished, pad_token_id)
        tokens[:, step] = token
        if logprobs is not None:
            logprobs[:, step] = all_logprobs.gather(-1, token[:, None]).squeeze(-1).masked_fill(finished, 0.0)
        if step >= min_new_tokens:  # earlier steps cannot draw EOS: no bookkeeping, no host sync
            just_ended = ~finished & (token == eos_token_id)
            lengths = torch.where(just_ended, step + 1, lengths)
            finished |= just_ended
            if bool(finished.all()):
                break
        if step + 1 == max_new_tokens:
            break
        logits = decoder.decode(token)

    completion_len = int(lengths.max()) if bool(finished.all()) else max_new_tokens
    tokens = tokens[:, :completion_len]
    completion_mask = (torch.arange(completion_len, device=device)[None, :] < lengths[:, None]).long()
    return Completions(
        prompt_ids=prompt_ids.repeat_interleave(group_size, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(group_size, dim=0),
        completion_ids=tokens,
        completion_mask=completion_mask,
        truncated=~finished,
        logprobs=logprobs[:, :completion_len] if logprobs is not None else None,
    )


def concat_completions(chunks: list[Completions], pad_token_id: int) -> Completions:
    """Join chunks of completions, padding prompts on the left and completions on the right."""
    if len(chunks) == 1:
        return chunks[0]
    prompt_len = max(c.prompt_ids.size(1) for c in chunks)
    completion_len = max(c.completion_ids.size(1) for c in chunks)

    def pad(t: Tensor, length: int, value: int, left: bool) -> Tensor:
        extra = length - t.size(1)
        return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra), value=value)

    return Completions(
        prompt_ids=torch.cat([pad(c.prompt_ids, prompt_len, pad_token_id, True) for c in chunks]),
        prompt_mask=torch.cat([pad(c.prompt_mask, prompt_len, 0, True) for c in chunks]),
        completion_ids=torch.cat([pad(c.completion_ids, completion_len, pad_token_id, False) for c in chunks]),
        completion_mask=torch.cat([pad(c.completion_mask, completion_len, 0, False) for c in chunks]),
        truncated=torch.cat([c.truncated for c in chunks]),
        logprobs=(
            torch.cat([pad(c.logprobs, completion_len, 0, False) for c in chunks])
            if all(c.logprobs is not None for c in chunks)
            else None
        ),
    )
