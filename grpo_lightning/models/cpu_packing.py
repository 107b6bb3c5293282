"""oneDNN's blocked weight layout for the lean forward's products on CPU, where no gradient is taken: the mechanism.

Why: for float32 products on CPU, torch calls MKL's ``sgemm``; oneDNN's kernels on a weight reordered once into
their blocked layout can run the same product faster, with q, k, v (gate, up) stacked into one product. Whether they
do depends on the machine and the product's shape (on AVX-512 they gained, on AVX2 the small ones lost), so where
they are used is decided per machine by ``models/cpu_packing_rule.py``; this file holds what both decisions share:

- ``product_groups``: a layer's products as the lean forward runs them (``qkv``, ``o``, ``gate_up``, ``down``), a
  group being packed, stacked where it has several parts, or left to ``F.linear`` on the parameters as a whole;
- ``packing_applies``: where packing may be used at all. The packed product has no backward and ignores autocast,
  so only float32 CPU tensors, without gradients, outside CPU autocast, in a torch build with oneDNN's ops;
- ``cpu_weight_packer`` (the reorder) and ``packed_linear`` (the product).

The reorder and the product are torch's own ops (as used by ``torch.compile``'s CPU backend) but not public API:
a weight that fails to reorder is left as it is, and ``tests/models/test_lean.py`` checks packed results against
the ``transformers`` forward and ``F.linear``. Packed and plain products differ in the last bits only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn

Packer = Callable[[Tensor], Tensor | None]
"""``weight -> packed weight``, or None where the weight stays as it is."""

GROUPS = ("qkv", "o", "gate_up", "down")
"""A decoder layer's products as the lean forward runs them (``product_groups``)."""


class PackPlan(NamedTuple):
    """Which of a pass's (or a rollout's decoding steps') product groups multiply by packed weights, and the
    ``Packer`` that reorders them; the other groups multiply by the parameters themselves."""

    packer: Packer
    groups: frozenset[str]


def product_groups(layer: nn.Module) -> dict[str, tuple[nn.Linear, ...]]:
    """A Llama-family decoder layer's linear layers by product group (``GROUPS``)."""
    attn, mlp = layer.self_attn, layer.mlp
    return {
        "qkv": (attn.q_proj, attn.k_proj, attn.v_proj),
        "o": (attn.o_proj,),
        "gate_up": (mlp.gate_proj, mlp.up_proj),
        "down": (mlp.down_proj,),
    }


def stackable(linears: tuple[nn.Linear, ...]) -> bool:
    """Whether a group's parts stack into one product: several parts, each with a bias or none with one (Qwen2's
    q, k, v all have one)."""
    return len(linears) > 1 and len({linear.bias is None for linear in linears}) == 1


def stacked_weight(linears: tuple[nn.Linear, ...]) -> tuple[Tensor, Tensor | None]:
    """The group's weights (and biases) stacked along the output dimension: a copy, outside autograd."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    bias = None if linears[0].bias is None else torch.cat([linear.bias.detach() for linear in linears])
    return weight, bias


@functools.cache
def onednn_available() -> bool:
    """Whether this torch build has oneDNN and the packed product's op."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._linear_pointwise  # noqa: B018 (the product ``packed_linear`` computes)
        torch.ops.mkldnn._reorder_linear_weight  # noqa: B018 (the reorder)
    except (AttributeError, RuntimeError):
        return False
    return True


def packing_applies(like: Tensor) -> bool:
    """Whether products on ``like`` (a model weight, or a pass's first hidden states) may multiply by packed
    weights: a float32 CPU tensor, gradients off, CPU autocast off (under ``bf16-mixed`` the products' inputs come
    in bfloat16, which the packed float32 product refuses), and oneDNN's ops present."""
    return (
        not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
        and like.device.type == "cpu"
        and like.dtype == torch.float32
        and onednn_available()
    )


def cpu_weight_packer(rows: int) -> Packer:
    """A ``Packer`` to oneDNN's blocked layout for products of about ``rows`` rows (float32 CPU weights; anything
    else, or a weight that fails to reorder, is left as it is)."""

    def pack(weight: Tensor) -> Tensor | None:
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return None
        try:
            return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
        except (AttributeError, RuntimeError):
            return None

    return pack


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear`` with a weight from a ``Packer``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
