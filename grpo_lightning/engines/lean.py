"""The ``lean`` engine: our own sampling loop, on the lean forward of ``grpo_lightning.models.lean``.

Instead of ``generate()``: each prompt is prefilled once and its keys and values shared by the G samples of its
group (written into buffers sized for the whole completion); each decoding step computes logits for the last
position only; the loop stops as soon as every sequence has ended. Prompts are left-padded, so position ids come
from the attention mask. Llama, Qwen2, Qwen3 and Mistral run on the lean forward; any other causal LM (and LoRA,
FSDP2 shards) runs the same loop on its own forward, step by step.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from grpo_lightning.engines.base import Completions, RolloutEngine, SamplingParams, concat_completions, eval_mode
from grpo_lightning.engines.token_sampling import draw, filter_logits
from grpo_lightning.models.lean import lean_unsupported, mask_positions
from grpo_lightning.models.lean_decoder import LeanDecoder


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
    eos_token_id: int | Sequence[int],
    pad_token_id: int,
    min_new_tokens: int = 0,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    return_logprobs: bool = False,
    lean: bool = True,
    stop_sequences: tuple[tuple[int, ...], ...] = (),
) -> Completions:
    """Sample ``group_size`` completions for each left-padded prompt in ``prompt_ids`` ``[B, P]``.

    With ``return_logprobs``, ``Completions.logprobs`` holds each drawn token's log-probability under the
    distribution it was drawn from (``engines/base.py``: tempered, EOS banned before ``min_new_tokens``, top-k and
    top-p applied, renormalised; the model's own at temperature 1 when ``greedy``), and ``policy_logprobs`` those
    of the tempered policy, unfiltered (the trainer's π_old on the same weights). With ``lean`` (and a model it
    supports, see ``grpo_lightning.models.lean``), the steps run on the lean forward. A sequence ends at any of
    ``eos_token_id`` (one id or several) or after any of ``stop_sequences`` (token ids, kept in the completion),
    neither before ``min_new_tokens`` tokens.
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
    filtered = not greedy and (top_k > 0 or top_p < 1.0 or min_new_tokens > 0)
    policy_logprobs = torch.zeros(n, max_new_tokens, device=device) if return_logprobs and filtered else None
    ends = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=device)
    stops = [torch.tensor(s, device=device) for s in stop_sequences if s]
    for step in range(max_new_tokens):
        if policy_logprobs is not None:  # the tempered policy's, before the EOS ban and the filters
            tempered = logits.float() / temperature if temperature != 1.0 else logits.float()
            policy_all = tempered.log_softmax(-1)
        if step < min_new_tokens:
            logits[:, ends] = float("-inf")
        if greedy:
            token = logits.argmax(-1)
            scores = logits.float() if logprobs is not None else None  # the model's own distribution
        else:
            scores = filter_logits(logits.float(), temperature=temperature, top_k=top_k, top_p=top_p)
            token = draw(scores, generator=generator)
        token = token.masked_fill(finished, pad_token_id)
        tokens[:, step] = token
        if logprobs is not None:  # of the distribution the token was drawn from
            drawn = scores.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
            logprobs[:, step] = drawn.masked_fill(finished, 0.0)
        if policy_logprobs is not None:
            policy_logprobs[:, step] = policy_all.gather(-1, token[:, None]).squeeze(-1).masked_fill(finished, 0.0)
        if step >= min_new_tokens:  # earlier steps cannot draw EOS: no bookkeeping, no host sync
            just_ended = ~finished & torch.isin(token, ends)
            for stop in stops:  # a tool call's close tag: the turn ends, the tag kept
                if step + 1 >= len(stop):
                    just_ended |= ~finished & (tokens[:, step + 1 - len(stop) : step + 1] == stop).all(-1)
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
        # unfiltered: the same tensor (the sampling distribution is the tempered policy)
        policy_logprobs=(policy_logprobs if policy_logprobs is not None else logprobs)[:, :completion_len]
        if logprobs is not None
        else None,
    )


class LeanEngine(RolloutEngine):
    """Samples with ``sample_completions`` from the policy module itself (shares its weights).

    ``lean_forward: false`` runs the loop on the model's own forward even where the lean forward applies.
    """

    name = "lean"
    shares_weights = True

    def __init__(self, lean_forward: bool = True) -> None:
        """
        Args:
            lean_forward: decode on ``grpo_lightning.models.lean`` where the model supports it.
        """
        super().__init__()
        self.lean_forward = lean_forward

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
        return_logprobs: bool = False,
    ) -> Completions:
        group_size = 1 if params.greedy else params.group_size
        prompts_per_chunk = max(1, params.batch_size // group_size)
        with eval_mode(self.policy):
            chunks = [
                sample_completions(
                    self.policy,
                    prompt_ids[start : start + prompts_per_chunk],
                    prompt_mask[start : start + prompts_per_chunk],
                    group_size=group_size,
                    max_new_tokens=params.max_new_tokens,
                    min_new_tokens=0 if params.greedy else params.min_new_tokens,
                    eos_token_id=self.eos_token_ids or self.eos_token_id,
                    pad_token_id=self.pad_token_id,
                    temperature=params.temperature,
                    top_k=params.top_k,
                    top_p=params.top_p,
                    greedy=params.greedy,
                    generator=generator,
                    return_logprobs=return_logprobs,
                    lean=self.lean_forward,
                    stop_sequences=params.stop_sequences,
                )
                for start in range(0, prompt_ids.size(0), prompts_per_chunk)
            ]
        return concat_completions(chunks, self.pad_token_id)


def supports_lean(model: nn.Module) -> bool:
    """Whether ``model`` decodes on the lean forward (else the loop runs on the model's own forward)."""
    return lean_unsupported(model) is None
