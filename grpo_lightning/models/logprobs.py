"""Log-probabilities (and entropies) of completion tokens, with bounded memory.

A naive implementation materialises ``[B, T, V]`` logits, a float32 copy and a full ``log_softmax`` (and, under
autograd, keeps them for the backward pass): memory grows with rows × length × vocabulary. Here the model runs up
to its output layer; hooks on that layer hand its input hidden states to ``LinearLogprobs``, which projects
``chunk_size`` completion tokens at a time and keeps only per-token results. Its backward pass recomputes each
chunk's logits and turns them into the logits' gradient in place, so at most two ``[chunk, V]`` float32 buffers
exist at any time, forward or backward. Padding positions are skipped entirely.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from grpo_lightning.models.lean import (
    PromptGroups,
    lean_unsupported,
    mask_positions,
    prompt_groups,
    shared_prompt_hidden,
)

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


def _layer_logprobs(
    layer: nn.Module, hidden: Tensor, labels: Tensor, temperature: float, with_entropy: bool, chunk_size: int
) -> Tensor:
    if type(layer) is nn.Linear:  # the usual lm_head: the fused function, two chunk buffers at most
        return LinearLogprobs.apply(hidden, layer.weight, layer.bias, labels, temperature, with_entropy, chunk_size)

    def logits_of(x: Tensor) -> Tensor:  # any other layer (a LoRA-wrapped head, ...): its own forward, by chunks
        logits = layer.forward(x)  # .forward: these calls must not re-enter the hooks
        return logits / temperature if temperature != 1.0 else logits

    return _chunked(logits_of, hidden, labels, with_entropy, chunk_size)


class LogprobLayout(NamedTuple):
    """Where a micro-batch's completion tokens and distinct prompts are, found once at rollout time.

    Finding them reads tensors on the host (a device sync); a training forward given them makes none. The rollout
    computes one per micro-batch (``logprob_layout``) and the update passes it on to ``completion_logprobs``.
    """

    positions: Tensor  # ``token_positions(completion_mask)``
    groups: PromptGroups  # ``prompt_groups(prompt_ids, prompt_mask)``


def logprob_layout(prompt_ids: Tensor, prompt_mask: Tensor, completion_mask: Tensor) -> LogprobLayout:
    """The ``LogprobLayout`` of a micro-batch."""
    return LogprobLayout(token_positions(completion_mask), prompt_groups(prompt_ids, prompt_mask))


def token_positions(completion_mask: Tensor) -> Tensor:
    """Flat indices of the completion tokens (``completion_mask`` ≠ 0) in ``[N, T]``, the positions whose log-probs
    are computed. Reading the mask syncs with the device: the update takes them precomputed with its micro-batch."""
    return completion_mask.flatten().nonzero().squeeze(1)


@contextmanager
def _logprobs_as_logits(
    layer: nn.Module, labels: Tensor, positions: Tensor, *, temperature: float, with_entropy: bool, chunk_size: int
) -> Iterator[dict[str, bool]]:
    """While active, ``layer`` returns ``[B, T + 1, 1 or 2]`` log-probs (and entropies) instead of logits.

    The model's forward runs unchanged up to its output layer; hooks on that layer take its input hidden states
    ``[B, T + 1, H]``, give it an empty slice to project, and replace its output with the log-probs of the
    completion tokens (the last position predicts nothing and gets zeros, as do padding positions). Doing it
    inside the model's forward keeps sharding wrappers (FSDP2: the output layer's weights are gathered then) and
    data-parallel gradient hooks (DDP) seeing an ordinary forward whose output feeds the loss.
    """
    state = {"fired": False}
    hidden: list[Tensor] = []

    def take_hidden(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden.append(args[0])
        return (args[0][:, :0], *args[1:])

    def logprobs_out(module: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor:
        states = hidden.pop()
        rows, length = labels.shape
        # Real completion tokens only, by (row, column): the states may be a strided slice of a larger tensor,
        # which flattening would copy whole.
        row = positions // length
        picked = states[row, positions - row * length]
        at = positions + row  # the same tokens' flat indices among the states' T + 1 positions per row
        stats = _layer_logprobs(
            module, picked, labels.flatten().index_select(0, positions), temperature, with_entropy, chunk_size
        )
        state["fired"] = True
        return stats.new_zeros(rows * (length + 1), stats.size(-1)).index_copy(0, at, stats).view(rows, length + 1, -1)

    handles = [layer.register_forward_pre_hook(take_hidden), layer.register_forward_hook(logprobs_out)]
    try:
        yield state
    finally:
        for handle in handles:
            handle.remove()


def _lean_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    labels: Tensor,
    positions: Tensor,
    temperature: float,
    with_entropy: bool,
    chunk_size: int,
    groups: PromptGroups | None,
) -> Tensor:
    """``[N, T, 1 or 2]`` from the lean forward: each distinct prompt runs once for its whole group."""
    hidden = shared_prompt_hidden(model, prompt_ids, prompt_mask, labels, groups)
    picked = hidden.flatten(0, 1).index_select(0, positions)
    stats = _layer_logprobs(
        model.lm_head, picked, labels.flatten().index_select(0, positions), temperature, with_entropy, chunk_size
    )
    return stats.new_zeros(labels.numel(), stats.size(-1)).index_copy(0, positions, stats).view(*labels.shape, -1)


def completion_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    micro_batch_size: int | None = None,
    with_entropy: bool = False,
    chunk_size: int | None = DEFAULT_LOGPROB_CHUNK,
    lean: bool = True,
    positions: Tensor | None = None,
    groups: PromptGroups | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs ``[N, T]`` of the completion tokens (and entropies), in micro-batches of rows.

    Prompts are left-padded (as ``rollout.prompts.PromptEncoder`` makes them): the last prompt position predicts the
    first completion token.

    Log-probs are those of the sampling distribution (logits divided by ``temperature``). With ``chunk_size``, the
    output layer projects ``chunk_size`` completion tokens at a time, so peak memory does not grow with rows ×
    length × vocabulary, and padding positions (``completion_mask == 0``) get 0. ``chunk_size=None`` keeps the
    plain path: the micro-batch's full logits from the model, then log-probs. With ``lean`` and a model that
    ``grpo_lightning.models.lean`` supports, rows sharing a prompt run it once (see ``shared_prompt_hidden``).

    ``positions`` (``token_positions(completion_mask)``) and ``groups`` (``prompt_groups(prompt_ids,
    prompt_mask)``), when given, are used instead of being found from the masks: with both, a lean pass makes no
    device sync (the model's own forward may still read its masks). They describe all rows, so they need a
    single micro-batch.
    """
    num_rows, completion_len = completion_ids.shape
    step = micro_batch_size or num_rows
    if (positions is not None or groups is not None) and step < num_rows:
        raise ValueError("completion_logprobs: precomputed positions/groups need micro_batch_size >= the rows")
    layer = output_layer(model) if chunk_size else None
    use_lean = lean and layer is not None and lean_unsupported(model) is None
    logprobs, entropies = [], []
    for start in range(0, num_rows, step):
        rows = slice(start, start + step)
        labels = completion_ids[rows]
        at = None  # flat indices of the completion tokens, for the chunked output layer
        if layer is not None:
            at = positions if positions is not None else token_positions(completion_mask[rows])
        if use_lean:
            stats = _lean_logprobs(
                model, prompt_ids[rows], prompt_mask[rows], labels, at, temperature, with_entropy, chunk_size, groups
            )
            logprobs.append(stats[..., 0])
            entropies.append(stats[..., 1] if with_entropy else None)
            continue
        input_ids = torch.cat([prompt_ids[rows], completion_ids[rows]], dim=1)
        attention = torch.cat([prompt_mask[rows], completion_mask[rows]], dim=1)
        hooks = (
            _logprobs_as_logits(
                layer, labels, at, temperature=temperature, with_entropy=with_entropy, chunk_size=chunk_size
            )
            if layer is not None
            else nullcontext({"fired": False})
        )
        with hooks as state:
            # use_cache=False: a training forward has no use for a KV cache, and building one costs memory.
            output = model(
                input_ids=input_ids,
                attention_mask=attention,
                position_ids=mask_positions(attention),
                logits_to_keep=completion_len + 1,
                use_cache=False,
            ).logits[:, :-1]
        if state["fired"]:
            chunk_logprobs, chunk_entropy = output[..., 0], (output[..., 1] if with_entropy else None)
        else:  # no usable output layer (or the model bypassed it): the model returned full logits
            if temperature != 1.0:
                output = output / temperature
            chunk_logprobs, chunk_entropy = token_logprobs(
                output, labels, with_entropy=with_entropy, chunk_size=chunk_size
            )
        logprobs.append(chunk_logprobs)
        entropies.append(chunk_entropy)
    return torch.cat(logprobs), (torch.cat(entropies) if with_entropy else None)
