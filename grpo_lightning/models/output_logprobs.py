"""Log-probabilities (and entropies) of chosen tokens from an output layer's input states, with bounded memory.

A naive implementation materialises ``[B, T, V]`` logits, a float32 copy and a full ``log_softmax`` (and, under
autograd, keeps them for the backward pass): memory grows with rows × length × vocabulary. ``LinearLogprobs``
projects ``chunk_size`` positions at a time and keeps only per-token results; its backward pass recomputes each
chunk's logits and turns them into the logits' gradient in place, so at most two ``[chunk, V]`` float32 buffers
exist at any time, forward or backward. ``layer_logprobs`` picks it for a plain ``nn.Linear`` head and otherwise
runs the layer's own forward chunk by chunk under activation checkpointing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

# Completion tokens whose full-vocabulary logits exist at once: 1024 × a 152k vocabulary in float32 is 0.6 GB,
# whatever the batch size and completion length.
DEFAULT_LOGPROB_CHUNK = 1024


def _compute_dtype(weight: Tensor) -> torch.dtype:
    # Under autocast the projection runs in the autocast dtype, as the model's own lm_head call would.
    device = weight.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise dot products ``[M]`` of ``[M, V]`` tensors, as a batched matmul (no ``[M, V]`` product tensor)."""
    return torch.matmul(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _project(hidden: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype, temperature: float) -> Tensor:
    """float32 logits ``[M, V]`` of ``hidden`` ``[M, H]``, divided by the sampling temperature."""
    logits = torch.nn.functional.linear(
        hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
    ).float()
    return logits.div_(temperature) if temperature != 1.0 else logits


class LinearLogprobs(torch.autograd.Function):
    """``[M, 1 or 2]``: log p(label) (and the entropy) of ``M`` positions of a linear output layer, by chunks."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        labels: Tensor,
        temperature: float,
        with_entropy: bool,
        chunk_size: int,
    ) -> Tensor:
        dtype = _compute_dtype(weight)
        out = hidden.new_empty(hidden.size(0), 2 if with_entropy else 1, dtype=torch.float32)
        lse = hidden.new_empty(hidden.size(0), dtype=torch.float32)
        for start in range(0, hidden.size(0), chunk_size):
            rows = slice(start, start + chunk_size)
            logits = _project(hidden[rows], weight, bias, dtype, temperature)
            lse[rows] = torch.logsumexp(logits, dim=-1)
            out[rows, 0] = logits.gather(-1, labels[rows, None]).squeeze(-1) - lse[rows]
            if with_entropy:
                # H = -Σ p log p = logsumexp(x) - Σ p x
                out[rows, 1] = lse[rows] - _rowdot(torch.softmax(logits, dim=-1), logits)
            del logits  # before the next chunk's buffers exist, not after
        ctx.save_for_backward(hidden, weight, bias, labels, lse, out)
        ctx.options = (temperature, with_entropy, chunk_size, dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, labels, lse, out = ctx.saved_tensors
        temperature, with_entropy, chunk_size, dtype = ctx.options
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_bias and bias is not None else None
        for start in range(0, hidden.size(0), chunk_size):
            rows = slice(start, start + chunk_size)
            g_lp = grad_out[rows, 0, None].float()
            log_p = _project(hidden[rows], weight, bias, dtype, temperature).sub_(lse[rows, None])
            # d log p(y) / dx = onehot(y) - p ;  d H / dx = -p (log p + H): written over the log_p buffer.
            if with_entropy:
                p = log_p.exp()
                g_h = grad_out[rows, 1, None].float()
                grad = log_p.add_(out[rows, 1, None]).mul_(-g_h).sub_(g_lp).mul_(p)
                del p
            else:
                grad = log_p.exp_().mul_(-g_lp)  # p, then its part of the gradient, in one buffer
            del log_p
            grad.scatter_add_(-1, labels[rows, None], g_lp)
            if temperature != 1.0:
                grad.div_(temperature)
            grad = grad.to(dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = (grad @ weight.to(dtype)).to(hidden.dtype)
            if grad_weight is not None:
                if dtype == torch.float32:
                    grad_weight.addmm_(grad.t(), hidden[rows].float())  # accumulates without a [V, H] temporary
                else:  # low-precision matmul, float32 accumulation across chunks
                    grad_weight += (grad.t() @ hidden[rows].to(dtype)).float()
            if grad_bias is not None:
                grad_bias += grad.float().sum(0)
            del grad  # before the next chunk's buffers exist, not after
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _chunk_logprobs(logits: Tensor, labels: Tensor, with_entropy: bool) -> Tensor:
    """``[M, 1 or 2]``: log p(label) (and the entropy) of ``M`` positions from their logits ``[M, V]``."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    columns = [logits.gather(-1, labels[:, None]).squeeze(-1) - lse]
    if with_entropy:
        columns.append(lse - _rowdot(torch.softmax(logits, dim=-1), logits))
    return torch.stack(columns, dim=-1)


def _chunked(
    logits_of: Callable[[Tensor], Tensor], inputs: Tensor, labels: Tensor, with_entropy: bool, chunk_size: int
) -> Tensor:
    """``_chunk_logprobs`` over ``chunk_size`` rows of ``inputs`` at a time, ``logits_of`` mapping rows to logits.

    Under autograd each chunk is recomputed in the backward pass (activation checkpointing), so one chunk's
    logits are alive at a time, in the forward pass and in the backward pass alike.
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

    Positions are processed ``chunk_size`` at a time (all at once when ``None``): the float32 copy and the softmax
    exist for one chunk only instead of for the whole ``[B, T, V]`` batch.
    """
    shape = labels.shape
    flat_logits, flat_labels = logits.reshape(-1, logits.size(-1)), labels.reshape(-1)
    stats = _chunked(lambda x: x, flat_logits, flat_labels, with_entropy, chunk_size or max(1, flat_labels.numel()))
    return stats[:, 0].reshape(shape), (stats[:, 1].reshape(shape) if with_entropy else None)


def output_layer(model: nn.Module) -> nn.Module | None:
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


def layer_logprobs(
    layer: nn.Module, hidden: Tensor, labels: Tensor, temperature: float, with_entropy: bool, chunk_size: int
) -> Tensor:
    """``[M, 1 or 2]``: log p(label) (and the entropy) of the ``M`` states ``hidden`` through ``layer``."""
    if type(layer) is nn.Linear:  # the usual lm_head: the fused function, two chunk buffers at most
        return LinearLogprobs.apply(hidden, layer.weight, layer.bias, labels, temperature, with_entropy, chunk_size)

    def logits_of(x: Tensor) -> Tensor:  # any other layer (a LoRA-wrapped head, ...): its own forward, by chunks
        logits = layer.forward(x)  # .forward: these calls must not re-enter the hooks
        return logits / temperature if temperature != 1.0 else logits

    return _chunked(logits_of, hidden, labels, with_entropy, chunk_size)
