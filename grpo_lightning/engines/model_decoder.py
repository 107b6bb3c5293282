"""Decoding on a model's own forward, for the ``lean`` engine's loop where the lean forward does not apply (any
other causal LM, LoRA, FSDP2 shards): ``ModelDecoder`` prefills a ``DynamicCache`` once per prompt, repeats it for
the G samples of its group into preallocated buffers (``PreallocatedLayer``), then decodes one token per row.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from grpo_lightning.models.lean_forward import mask_positions


class PreallocatedLayer(DynamicLayer):
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

    @classmethod
    def from_buffers(cls, keys: Tensor, values: Tensor, filled: int) -> PreallocatedLayer:
        """A layer on kept buffers ``[rows, heads, capacity, D]`` whose first ``filled`` columns are set."""
        layer = cls.__new__(cls)
        DynamicLayer.__init__(layer)
        layer._keys, layer._values = keys, values
        layer.device, layer.is_initialized = keys.device, True
        layer.keys, layer.values = keys[..., :filled, :], values[..., :filled, :]
        return layer

    def select(self, rows: Tensor) -> None:
        """Keep only ``rows`` of the batch (their filled columns, in buffers of the same capacity)."""
        filled = self.keys.size(-2)
        for name in ("_keys", "_values"):
            buffer = getattr(self, name)
            kept = buffer.new_empty(rows.numel(), *buffer.shape[1:])
            kept[..., :filled, :] = buffer[rows, ..., :filled, :]
            setattr(self, name, kept)
        self.keys, self.values = self._keys[..., :filled, :], self._values[..., :filled, :]

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
        cache.layers = [PreallocatedLayer(layer, repeats, capacity) for layer in layers]
    else:
        cache.batch_repeat_interleave(repeats)


def cache_kwarg(model: PreTrainedModel) -> str:
    """The name of the KV cache argument of ``model``'s forward (and ``generate``): ``cache`` or ``past_key_values``."""
    # transformers 5 renamed ``past_key_values`` to ``cache`` in the forward signature. A PEFT wrapper keeps the old
    # name in its own signature and passes either through: ask the model it wraps.
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


class ModelDecoder:
    """Sampling steps on the model's own forward (any architecture): a ``DynamicCache`` prefilled once per prompt,
    then repeated for the G samples of its group into preallocated buffers."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model, self.cache_kwarg = model, cache_kwarg(model)

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

    def resume(
        self,
        keys: list[Tensor],
        values: list[Tensor],
        valid: Tensor,
        new_ids: Tensor,
        new_mask: Tensor,
        positions: Tensor,
    ) -> Tensor:
        """``LeanDecoder.resume`` on the model's own forward: the kept buffers become the cache's layers."""
        self.cache = DynamicCache(config=self.model.config)
        self.cache.layers = [PreallocatedLayer.from_buffers(k, v, valid.size(1)) for k, v in zip(keys, values)]
        self.attention = torch.cat([valid.long(), new_mask.long()], dim=1)
        out = self.model(
            input_ids=new_ids,
            attention_mask=self.attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kwarg: self.cache},
        )
        self.positions = positions[:, -1:]
        return out.logits[:, -1]

    @property
    def filled(self) -> int:
        """Columns of the cache written so far (``LeanDecoder.filled``)."""
        return self.attention.size(1)

    def kept(self) -> tuple[list[Tensor], list[Tensor], Tensor] | None:
        """``LeanDecoder.kept``; None when the cache's layers are not preallocated ones (sliding-window, ...)."""
        if not self.selectable:
            return None
        layers = self.cache.layers
        return [layer._keys for layer in layers], [layer._values for layer in layers], self.attention.bool()

    @property
    def selectable(self) -> bool:
        """Whether ``select`` applies: every cache layer is a preallocated one (not sliding-window, linear-attention
        or quantized layers, which keep their own rules)."""
        layers = getattr(self.cache, "layers", None)
        return bool(layers) and all(isinstance(layer, PreallocatedLayer) for layer in layers)

    def select(self, rows: Tensor) -> None:
        """Go on decoding ``rows`` (indices into the batch) only: the others' keys and values are dropped."""
        for layer in self.cache.layers:
            layer.select(rows)
        self.attention, self.positions = self.attention[rows], self.positions[rows]

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
