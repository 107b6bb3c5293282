"""Decoding on the lean forward: ``LeanDecoder`` (a shared prefill, or only the new tokens after kept keys and
values, then one token per row into preallocated key and value buffers), its weights read once for all steps
(on CPU, where it pays, in oneDNN's blocked layout: ``models/cpu_packing_rule.py``).

The ``lean`` rollout engine (``grpo_lightning.engines.lean``) samples with it; ``models/lean_forward.py`` holds the
forward.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from grpo_lightning.models.cpu_packing_rule import decode_plan
from grpo_lightning.models.lean_forward import (
    Projection,
    decoder_hidden,
    decoder_weights,
    linear,
    mask_positions,
    norm_weights,
    rms_norm,
    run_prompts,
)


class LeanDecoder:
    """Sampling steps on the lean forward: a shared prefill, then one token per row into preallocated buffers.

    ``prefill`` runs each prompt once and copies its keys and values into buffers sized for the whole completion,
    once per sample of its group; ``decode`` writes one position per step and attends to the filled part. On CPU,
    weights are pre-packed for the decoding steps where that pays (``decode_plan``).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @torch.no_grad()
    def prefill(self, prompt_ids: Tensor, prompt_mask: Tensor, group_size: int, max_new_tokens: int) -> Tensor:
        """Last-position logits ``[B, V]`` of the prompts; sets up G rows per prompt for ``decode``."""
        hidden, keys, values = run_prompts(self.model, prompt_ids, prompt_mask)
        rows, length = prompt_ids.size(0), prompt_ids.size(1)
        capacity = length + max_new_tokens
        self.keys, self.values = [], []
        for prefix_k, prefix_v in zip(keys, values):
            for prefix, buffers in ((prefix_k, self.keys), (prefix_v, self.values)):
                buffer = prefix.new_empty(rows * group_size, prefix.size(1), capacity, prefix.size(-1))
                buffer.view(rows, group_size, *buffer.shape[1:])[..., :length, :] = prefix[:, None]
                buffers.append(buffer)
        self.filled = length
        # Padded prompts: a key mask over the buffer (prompt padding masked, generated positions open).
        key_mask = None
        if not bool(prompt_mask.all()):
            key_mask = torch.ones(rows * group_size, capacity, dtype=torch.bool, device=prompt_ids.device)
            key_mask[:, :length] = prompt_mask.bool().repeat_interleave(group_size, dim=0)
        positions = mask_positions(prompt_mask)[:, -1:].repeat_interleave(group_size, dim=0)
        return self._start_decoding(hidden[:, -1], positions, key_mask)

    @torch.no_grad()
    def resume(
        self,
        keys: list[Tensor],
        values: list[Tensor],
        valid: Tensor,
        new_ids: Tensor,
        new_mask: Tensor,
        positions: Tensor,
    ) -> Tensor:
        """Last-position logits ``[N, V]`` after appending ``new_ids`` ``[N, C]`` (left-padded: ``new_mask``; at
        ``positions``) to rows whose earlier keys and values are kept: per layer ``[N, heads, capacity, D]``,
        columns ``valid`` ``[N, W]`` holding the rows' tokens. Only the new tokens are computed; ``decode``
        follows, writing into the same buffers."""
        rows, width = valid.shape
        chunk = new_ids.size(1)
        end = width + chunk
        self.keys, self.values = keys, values
        causal = torch.ones(chunk, chunk, dtype=torch.bool, device=new_ids.device).tril()
        # A padding query attends to itself too: a query with no key would give NaN (see ``_prompt_mask_4d``).
        own = (causal & new_mask.bool()[:, None, :]) | torch.eye(chunk, dtype=torch.bool, device=new_ids.device)
        mask = torch.cat([valid[:, None, :].expand(rows, chunk, width), own], dim=-1)[:, None]

        def write(layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
            self.keys[layer][:, :, width:end] = k
            self.values[layer][:, :, width:end] = v
            return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

        hidden = decoder_hidden(self.model, new_ids, positions, mask, write)
        self.filled = end
        key_mask = torch.ones(rows, keys[0].size(2), dtype=torch.bool, device=new_ids.device)
        key_mask[:, :width], key_mask[:, width:end] = valid, new_mask.bool()
        return self._start_decoding(hidden[:, -1], positions[:, -1:], key_mask)

    def _start_decoding(self, last_hidden: Tensor, positions: Tensor, key_mask: Tensor | None) -> Tensor:
        """The logits of ``last_hidden``; the state ``decode`` starts from: ``positions`` ``[N, 1]`` of the decoding
        rows' last tokens, ``key_mask`` ``[N, capacity]`` (None: every column open)."""
        # Read once for all decoding steps (at most the buffers' free columns but the last: the last token drawn is
        # never fed back); on CPU in float32 without autocast, the product groups where packing pays over that many
        # steps are stacked and pre-packed (``decode_plan``).
        steps = self.keys[0].size(2) - self.filled - 1
        self.layers = decoder_weights(self.model, decode_plan(self.model, positions.size(0), steps))
        self.positions, self.key_mask = positions, key_mask
        self.final_norm = norm_weights(self.model.model.norm)
        self.output = Projection(self.model.lm_head.weight, self.model.lm_head.bias)
        return linear(rms_norm(last_hidden, self.final_norm), self.output)

    selectable = True  # ``select`` applies (as with the model's own forward on preallocated cache layers)

    def select(self, rows: Tensor) -> None:
        """Go on decoding ``rows`` (indices into the batch) only: the others' keys and values are dropped."""
        keys, values, self.keys, self.values = self.keys, self.values, [], []
        for old, new in ((keys, self.keys), (values, self.values)):
            for buffer in old:
                kept = buffer.new_empty(rows.numel(), *buffer.shape[1:])
                kept[:, :, : self.filled] = buffer[rows, :, : self.filled]  # the filled columns: all that is read
                new.append(kept)
        self.positions = self.positions[rows]
        self.key_mask = None if self.key_mask is None else self.key_mask[rows]

    def kept(self) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """Each layer's key and value buffers, and which of the ``filled`` columns hold real tokens ``[N, filled]``
        (prompt padding does not), for a later ``resume``."""
        if self.key_mask is None:
            valid = torch.ones(self.keys[0].size(0), self.filled, dtype=torch.bool, device=self.keys[0].device)
        else:
            valid = self.key_mask[:, : self.filled].clone()
        return self.keys, self.values, valid

    @torch.no_grad()
    def decode(self, tokens: Tensor) -> Tensor:
        """Logits ``[N, V]`` after appending ``tokens`` ``[N]`` (one per row) to every sequence."""
        self.positions = self.positions + 1
        column, end = self.filled, self.filled + 1

        def write(layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
            self.keys[layer][:, :, column : column + 1] = k
            self.values[layer][:, :, column : column + 1] = v
            return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

        mask = None if self.key_mask is None else self.key_mask[:, None, None, :end]
        hidden = decoder_hidden(self.model, tokens[:, None], self.positions, mask, write, self.layers)
        self.filled = end
        return linear(rms_norm(hidden[:, -1], self.final_norm), self.output)
