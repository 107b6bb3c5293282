"""oneDNN's blocked weight layout for the lean forward's products on CPU, where no gradient is taken.

Why: for float32 products on CPU, torch calls MKL's ``sgemm``; oneDNN's kernels on a weight reordered once into
their blocked layout run the same product faster. Measured on 2 cores of an AMD EPYC (AVX-512), products of
32 rows by a 256-wide layer's weights 1.2–1.5× (decoding steps), of 2016 rows by a 512-wide layer's 1.3–1.4× (the
teacher's or a reference model's pass over a rollout); on an AVX2 machine decoding steps gained about 20%. Reordering
a layer's weights costs about what the faster products save over ~350 rows, so:

- decoding steps (``LeanDecoder``) reorder once per rollout and reuse the layout for every step;
- a forward pass without gradients (π_old, π_ref, the teacher, a prefill) reorders each layer's weights just
  before that layer runs, when the pass has at least ``PASS_MIN_TOKENS`` positions, and drops them after it
  (``pass_packer``): memory grows by one layer's weights at most.

The reorder and the product are torch's own ops (as used by ``torch.compile``'s CPU backend) but not public API:
a weight that fails to reorder is left as it is, and ``tests/models/test_lean.py`` checks packed results against
``F.linear``. Products under autocast, in another dtype than float32, off the CPU or with gradients never take
this path (the packed product has no backward and ignores autocast).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# Decoding steps pre-pack weights of at least this many elements: below, the product is too small to gain (an
# output layer over a character vocabulary ran slower packed).
PACK_MIN_ELEMENTS = 1 << 16

# A forward pass without gradients packs its layers' weights when it computes at least this many positions: the
# reorder then costs about two thirds or less of what the faster products save (the pass of the teacher of
# ``tools/bench_distill.py``, 512 prompt and 2016 completion positions, ran 0.90 s with both passes packed, 0.92 s
# with the completions' only, 1.02 s with neither).
PASS_MIN_TOKENS = 512

Packer = Callable[[Tensor], Tensor | None]
"""``weight -> packed weight``, or None where the weight stays as it is."""


def cpu_weight_packer(rows: int, min_elements: int = PACK_MIN_ELEMENTS, like: Tensor | None = None) -> Packer | None:
    """A ``Packer`` to oneDNN's blocked layout for products of about ``rows`` rows, for float32 CPU weights of at
    least ``min_elements`` elements; None when this torch build has no oneDNN, or when ``like`` (a weight of the
    model) is not a float32 CPU tensor (nothing would be packed: no copies are made then either)."""
    if like is not None and (like.device.type != "cpu" or like.dtype != torch.float32):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        torch.ops.mkldnn._linear_pointwise  # noqa: B018 (the product ``packed_linear`` computes)
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


def pass_packer(hidden: Tensor, positions: int) -> Packer | None:
    """The ``Packer`` for a forward pass over ``positions`` positions whose first hidden states are ``hidden``;
    None (plain products) with gradients enabled, under CPU autocast, off the CPU, in another dtype than float32,
    or for fewer than ``PASS_MIN_TOKENS`` positions."""
    if torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or positions < PASS_MIN_TOKENS:
        return None
    return cpu_weight_packer(positions, min_elements=0, like=hidden)


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear`` with a weight from a ``Packer``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
