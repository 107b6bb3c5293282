"""The SwiGLU block's output projection, ``down(silu(gate) * up)``, keeping only ``gate`` and ``up`` for backward.

Why: autograd keeps four ``[tokens, intermediate]`` tensors per layer for this block (``gate``, ``silu(gate)``,
``up`` and their product, the input of ``down``); two of them are cheap functions of the other two. Recomputing
them in backward halves the block's saved activations, the largest share of a training forward's memory in a
Llama-family layer (``intermediate`` ≈ 2.7 × ``hidden``). Same kernels, same order of operations as autograd's, so
values and gradients are autograd's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


class SwiGLUDown(torch.autograd.Function):
    """``F.linear(silu(gate) * up, weight, bias)``, saving ``gate``, ``up`` and ``weight`` only.

    Works in the inputs' dtype: under autocast ``gate`` and ``up`` already come in the autocast dtype, and the
    weight and bias are cast to it as autocast's own ``linear`` would (their gradients go back in their own dtype).
    """

    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        with torch.autocast(gate.device.type, enabled=False):
            hidden = F.silu(gate) * up
            out = F.linear(hidden, weight.to(gate.dtype), None if bias is None else bias.to(gate.dtype))
        ctx.save_for_backward(gate, up, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        gate, up, weight = ctx.saved_tensors
        with torch.autocast(gate.device.type, enabled=False):
            activation = F.silu(gate)
            grad_hidden = grad_out.matmul(weight.to(gate.dtype))
            grad_gate = grad_up = grad_weight = grad_bias = None
            if ctx.needs_input_grad[0]:
                grad_gate = torch.ops.aten.silu_backward(grad_hidden * up, gate)
            if ctx.needs_input_grad[1]:
                grad_up = grad_hidden * activation
            if ctx.needs_input_grad[2]:
                flat_grad = grad_out.reshape(-1, grad_out.size(-1))
                hidden = (activation * up).reshape(-1, up.size(-1))
                grad_weight = flat_grad.t().matmul(hidden).to(weight.dtype)
            if ctx.bias_dtype is not None and ctx.needs_input_grad[3]:
                grad_bias = grad_out.reshape(-1, grad_out.size(-1)).sum(0).to(ctx.bias_dtype)
        return grad_gate, grad_up, grad_weight, grad_bias


def swiglu_down(gate: Tensor, up: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(silu(gate) * up, weight, bias)``; with gradients enabled, through ``SwiGLUDown``."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (gate, up, weight, bias)):
        return SwiGLUDown.apply(gate, up, weight, bias)
    return F.linear(F.silu(gate) * up, weight, bias)
