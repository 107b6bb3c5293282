"""Decoding on the lean forward: ``LeanDecoder`` (a shared prefill, then one token per row into preallocated key and
value buffers) and ``cpu_weight_packer`` (oneDNN's blocked weight layout for the decoding steps' products).

The ``lean`` rollout engine (``grpo_lightning.engines.lean``) samples with it; ``models/lean.py`` holds the forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from grpo_lightning.models.lean import (
    Projection,
    decoder_hidden,
    decoder_weights,
    linear,
    mask_positions,
    norm_weights,
    rms_norm,
    run_prompts,
)

# Decoding steps on CPU pre-pack weights of at least this many elements (see ``cpu_weight_packer``).
PACK_MIN_ELEMENTS = 1 << 18


def cpu_weight_packer(rows: int, min_elements: int = PACK_MIN_ELEMENTS) -> Callable[[Tensor], Tensor | None] | None:
    """``weight -> packed weight or None``: pre-packs weights in oneDNN's blocked layout for ``rows``-row products.

    Why: a decoding step multiplies ``rows`` vectors by every weight matrix, so on CPU it is bound by reading the
    weights from memory; the blocked layout streams them about 20% faster (measured on settings B of
    ``tools/bench_trl.py``). Small weights stay in cache anyway and gain nothing: they, and weights off the CPU or
    not in float32, are left as they are (None). The function is None when this torch build has no oneDNN. The
    packing ops are torch's own (as used by ``torch.compile``'s CPU backend) but not public API, so a weight that
    fails to pack is left as it is; ``tests/models/test_lean.py`` checks packed results against ``F.linear``.
    """
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        torch.ops.mkldnn._linear_pointwise  # noqa: B018 (the product ``_linear`` computes on packed weights)
    except (AttributeError, RuntimeError):
        return None

    def pack(weight: Tensor) -> Tensor | None:
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.numel() < min_elements:
            return None
        try:
            return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
        except (AttributeError, RuntimeError):
            return None

    return pack


class LeanDecoder:
    """Sampling steps on the lean forward: a shared prefill, then one token per row into preallocated buffers.

    ``prefill`` runs each prompt once and copies its keys and values into buffers sized for the whole completion,
    once per sample of its group; ``decode`` writes one position per step and attends to the filled part. On CPU,
    large weights are pre-packed for the decoding steps (``cpu_weight_packer``).
    """

    def __init__(self, model: nn.Module, pack_min_elements: int = PACK_MIN_ELEMENTS) -> None:
        self.model, self.pack_min_elements = model, pack_min_elements

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
        # Read once for all decoding steps, with large weights pre-packed on CPU (``cpu_weight_packer``).
        self.layers = decoder_weights(self.model, cpu_weight_packer(rows * group_size, self.pack_min_elements))
        self.positions = mask_positions(prompt_mask)[:, -1:].repeat_interleave(group_size, dim=0)
        # Padded prompts: a key mask over the buffer (prompt padding masked, generated positions open).
        self.key_mask = None
        if not bool(prompt_mask.all()):
            self.key_mask = torch.ones(rows * group_size, capacity, dtype=torch.bool, device=prompt_ids.device)
            self.key_mask[:, :length] = prompt_mask.bool().repeat_interleave(group_size, dim=0)
        self.final_norm = norm_weights(self.model.model.norm)
        self.output = Projection(self.model.lm_head.weight, self.model.lm_head.bias)
        return linear(rms_norm(hidden[:, -1], self.final_norm), self.output)

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
