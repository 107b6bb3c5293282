"""``models/swiglu.py``: the SwiGLU block with half the saved activations gives autograd's values and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from grpo_lightning.models.swiglu import swiglu_down

TOKENS, HIDDEN, INTERMEDIATE = 7, 16, 40


def inputs(dtype: torch.dtype, bias: bool):
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(3, TOKENS, HIDDEN, generator=generator, dtype=dtype, requires_grad=True)
    w_gate = torch.randn(INTERMEDIATE, HIDDEN, generator=generator, dtype=dtype, requires_grad=True)
    w_up = torch.randn(INTERMEDIATE, HIDDEN, generator=generator, dtype=dtype, requires_grad=True)
    w_down = torch.randn(HIDDEN, INTERMEDIATE, generator=generator, dtype=dtype, requires_grad=True)
    b_down = torch.randn(HIDDEN, generator=generator, dtype=dtype, requires_grad=True) if bias else None
    return h, w_gate, w_up, w_down, b_down


def run(fused: bool, dtype: torch.dtype, bias: bool, autocast: bool):
    h, w_gate, w_up, w_down, b_down = tensors = inputs(dtype, bias)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        gate, up = F.linear(h, w_gate), F.linear(h, w_up)
        out = swiglu_down(gate, up, w_down, b_down) if fused else F.linear(F.silu(gate) * up, w_down, b_down)
    weights = torch.linspace(-1, 1, out.numel()).view_as(out)
    (out.float() * weights).sum().backward()
    return out.detach(), [t.grad for t in tensors if t is not None]


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(
    "dtype,autocast",
    [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
    ids=["f32", "bf16", "amp"],
)
def test_values_and_gradients_are_autograds(dtype, autocast, bias):
    """Same kernels in the same order as autograd's: equal bit for bit, in every dtype, with or without autocast
    (under autocast the fused block computes in bfloat16 and returns float32 weight gradients, as autocast does)."""
    out, grads = run(True, dtype, bias, autocast)
    expected_out, expected_grads = run(False, dtype, bias, autocast)
    assert out.dtype == expected_out.dtype == (torch.bfloat16 if autocast else dtype)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    for grad, expected in zip(grads, expected_grads, strict=True):
        assert grad.dtype == expected.dtype
        torch.testing.assert_close(grad, expected, rtol=0, atol=0)


def saved_bytes(fused: bool) -> int:
    """Bytes autograd keeps for backward from the block (its input ``h`` and the weights excluded)."""
    h, w_gate, w_up, w_down, _ = inputs(torch.float32, bias=False)
    kept = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.numel() == 3 * TOKENS * INTERMEDIATE:  # activations (any view of them), not h nor the weights
            kept[t.data_ptr()] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gate, up = F.linear(h, w_gate), F.linear(h, w_up)
        swiglu_down(gate, up, w_down, None) if fused else F.linear(F.silu(gate) * up, w_down)
    return sum(kept.values())


def test_it_keeps_half_the_activations_autograd_keeps():
    """autograd keeps gate, silu(gate), up and their product; the fused block keeps gate and up."""
    per_tensor = 3 * TOKENS * INTERMEDIATE * 4
    assert saved_bytes(fused=False) == 4 * per_tensor
    assert saved_bytes(fused=True) == 2 * per_tensor


def test_without_gradients_it_is_the_plain_block():
    h, w_gate, w_up, w_down, b_down = (t.detach() if t is not None else None for t in inputs(torch.float32, True))
    gate, up = F.linear(h, w_gate), F.linear(h, w_up)
    out = swiglu_down(gate, up, w_down, b_down)
    assert out.grad_fn is None
    torch.testing.assert_close(out, F.linear(F.silu(gate) * up, w_down, b_down), rtol=0, atol=0)
