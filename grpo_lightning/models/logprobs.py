"""Log-probabilities (and entropies) of completion tokens, with bounded memory, padded or packed.

The model runs up to its output layer; hooks on that layer hand its input hidden states to
``output_logprobs.layer_logprobs``, which projects ``chunk_size`` completion tokens at a time and keeps only
per-token results (at most two ``[chunk, V]`` float32 buffers, forward or backward). Padding positions are skipped
entirely. The layer's input comes from the lean forward (``models/lean_forward.py``: each distinct prompt once), or the
model's own forward, and either of them padded (rows × the longest completion) or packed (``models/packing.py``:
token-budget bins of the sequences' real tokens, ``pack_tokens``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from grpo_lightning.modality import TEXT, Modality
from grpo_lightning.models.lean_forward import (
    PromptGroups,
    lean_unsupported,
    prompt_groups,
    shared_prompt_hidden,
)
from grpo_lightning.models.output_logprobs import (  # LinearLogprobs, token_logprobs: also imported from here
    DEFAULT_LOGPROB_CHUNK,
    LinearLogprobs,
    layer_logprobs,
    output_layer,
    token_logprobs,
)
from grpo_lightning.models.packing import (
    full_packing,
    lean_packed_hidden,
    lean_packing,
    pack_budget,
    packing_isolates,
)

__all__ = [
    "DEFAULT_LOGPROB_CHUNK",
    "LinearLogprobs",
    "LogprobLayout",
    "completion_logprobs",
    "logprob_layout",
    "output_layer",
    "token_logprobs",
    "token_positions",
]


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
    layer: nn.Module,
    labels: Tensor,
    pick: Callable[[Tensor], Tensor],
    place: Callable[[Tensor], Tensor],
    *,
    temperature: float,
    with_entropy: bool,
    chunk_size: int,
) -> Iterator[dict[str, bool]]:
    """While active, ``layer`` returns ``place(log-probs (and entropies) of the states pick(its input) chose)``
    instead of logits.

    The model's forward runs unchanged up to its output layer; hooks on that layer take its input hidden states,
    give it an empty slice to project, and replace its output with the log-probs of the completion tokens
    (``labels``, one per picked state). Doing it inside the model's forward keeps sharding wrappers (FSDP2: the
    output layer's weights are gathered then) and data-parallel gradient hooks (DDP) seeing an ordinary forward
    whose output feeds the loss.
    """
    state = {"fired": False}
    hidden: list[Tensor] = []

    def take_hidden(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden.append(args[0])
        return (args[0][:, :0], *args[1:])

    def logprobs_out(module: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor:
        stats = layer_logprobs(module, pick(hidden.pop()), labels, temperature, with_entropy, chunk_size)
        state["fired"] = True
        return place(stats)

    handles = [layer.register_forward_pre_hook(take_hidden), layer.register_forward_hook(logprobs_out)]
    try:
        yield state
    finally:
        for handle in handles:
            handle.remove()


def _placed(labels: Tensor, positions: Tensor) -> Callable[[Tensor], Tensor]:
    """``[M, k]`` stats of the completion tokens at ``positions`` -> ``[N, T, k]``, zeros elsewhere."""
    return lambda stats: (
        stats.new_zeros(labels.numel(), stats.size(-1)).index_copy(0, positions, stats).view(*labels.shape, -1)
    )


def _packed_logprobs(
    model: nn.Module,
    layer: nn.Module,
    lean: bool,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    labels: Tensor,
    completion_mask: Tensor,
    positions: Tensor,
    groups: PromptGroups | None,
    budget: int | None,
    options: dict[str, Any],
) -> Tensor:
    """``[N, T, 1 or 2]`` from a packed forward (``models/packing.py``): lean, or the model's own."""
    labels_at, place = labels.flatten().index_select(0, positions), _placed(labels, positions)
    if lean:
        groups = groups if groups is not None else prompt_groups(prompt_ids, prompt_mask)
        packing = lean_packing(prompt_mask, completion_mask, groups, budget)
        states = lean_packed_hidden(model, prompt_ids, prompt_mask, labels, groups, packing)
        return place(layer_logprobs(model.lm_head, states, labels_at, **options))
    packing = full_packing(prompt_ids, prompt_mask, labels, completion_mask, budget)

    def pick(states: Tensor) -> Tensor:
        return states.flatten(0, 1).index_select(0, packing.source)

    with _logprobs_as_logits(layer, labels_at, pick, place, **options) as state:
        output = model(input_ids=packing.input_ids, position_ids=packing.position_ids, use_cache=False).logits
    if state["fired"]:
        return output
    # The model bypassed its output layer: log-probs from its full logits, at the packed positions.
    logits = pick(output) / options["temperature"]
    logprobs, entropy = token_logprobs(
        logits[:, None], labels_at[:, None], with_entropy=options["with_entropy"], chunk_size=options["chunk_size"]
    )
    return place(torch.cat([logprobs, entropy], dim=-1) if entropy is not None else logprobs)


def _pick_padded(labels: Tensor, positions: Tensor) -> Callable[[Tensor], Tensor]:
    """The states ``[N, T + 1, H]`` of the completion tokens at ``positions``, by (row, column): the states may be a
    strided slice of a larger tensor, which flattening would copy whole."""
    length = labels.size(1)
    row = positions // length
    return lambda states: states[row, positions - row * length]


def _placed_padded(labels: Tensor, positions: Tensor) -> Callable[[Tensor], Tensor]:
    """Stats -> ``[N, T + 1, k]`` (the last position predicts nothing and gets zeros, as do padding positions)."""
    rows, length = labels.shape
    at = positions + positions // length  # the same tokens' flat indices among the T + 1 positions per row
    return lambda stats: (
        stats.new_zeros(rows * (length + 1), stats.size(-1)).index_copy(0, at, stats).view(rows, length + 1, -1)
    )


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
    stats = layer_logprobs(
        model.lm_head, picked, labels.flatten().index_select(0, positions), temperature, with_entropy, chunk_size
    )
    return _placed(labels, positions)(stats)


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
    pack_tokens: int | str | None = None,
    vision: Sequence[Mapping[str, Tensor]] | None = None,
    modality: Modality = TEXT,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs ``[N, T]`` of the completion tokens (and entropies), in micro-batches of rows.

    Prompts are left-padded (as ``rollout.prompts.PromptEncoder`` makes them): the last prompt position predicts the
    first completion token.

    Log-probs are those of the sampling distribution (logits divided by ``temperature``). With ``chunk_size``, the
    output layer projects ``chunk_size`` completion tokens at a time, so peak memory does not grow with rows ×
    length × vocabulary, and padding positions (``completion_mask == 0``) get 0. ``chunk_size=None`` keeps the
    plain path: the micro-batch's full logits from the model, then log-probs. With ``lean`` and a model that
    ``grpo_lightning.models.lean_forward`` supports, rows sharing a prompt run it once (see ``shared_prompt_hidden``).

    ``positions`` (``token_positions(completion_mask)``) and ``groups`` (``prompt_groups(prompt_ids,
    prompt_mask)``), when given, are used instead of being found from the masks: with both, a lean pass makes no
    device sync (the model's own forward may still read its masks). They describe all rows, so they need a
    single micro-batch.

    ``pack_tokens``: None runs padded rows; a number packs each micro-batch's sequences into bins of that many
    tokens, ``"auto"`` into bins as long as its longest sequence when that saves a quarter of the padded tokens
    (``pack_budget``), and runs the bins (``models/packing.py``): on the lean forward, or on the model's own when
    its attention keeps packed sequences apart (``packing_isolates``; padded otherwise). Packing needs the chunked
    output layer (``chunk_size`` set); without one the rows run padded.

    ``vision``: each row's inputs beyond its ids (``grpo_lightning/modality.py: Rows``; a vision-language model's
    image inputs), which ``modality`` gives the forward: each micro-batch's own rows' (``Modality.forward_inputs``:
    a vision-language model's joined images and the positions they need, Qwen-VL's 3-D M-RoPE), on the model's own
    forward, padded (no lean forward, no packing: both take ids alone). Without them, the text path's positions.
    """
    if vision is None:
        modality = TEXT  # no row inputs: the text path, whatever the model
    elif not modality.has_row_inputs:
        raise ValueError(
            "completion_logprobs: rows with inputs (vision=) need the modality that gives them (modality=)"
        )
    else:
        modality.check_pass(model, completion_ids, completion_mask, pack_tokens)
        lean, pack_tokens = False, None
    num_rows, completion_len = completion_ids.shape
    step = micro_batch_size or num_rows
    if (positions is not None or groups is not None) and step < num_rows:
        raise ValueError("completion_logprobs: precomputed positions/groups need micro_batch_size >= the rows")
    layer = output_layer(model) if chunk_size else None
    use_lean = lean and layer is not None and lean_unsupported(model) is None
    options = {"temperature": temperature, "with_entropy": with_entropy, "chunk_size": chunk_size}
    # Whether the own forward may pack, decided before any micro-batch and alike on every rank: the probe runs
    # the model, which under FSDP2 is a collective every rank must join, whatever its own rows would choose.
    own_packs = pack_tokens is not None and layer is not None and not use_lean and packing_isolates(model)
    logprobs, entropies = [], []
    for start in range(0, num_rows, step):
        rows = slice(start, start + step)
        labels = completion_ids[rows]
        at = None  # flat indices of the completion tokens, for the chunked output layer
        if layer is not None:
            at = positions if positions is not None else token_positions(completion_mask[rows])
        budget = pack_budget(pack_tokens, completion_mask[rows]) if layer is not None else None
        if budget is not None and (use_lean or own_packs):
            stats = _packed_logprobs(
                model, layer, use_lean, prompt_ids[rows], prompt_mask[rows], labels, completion_mask[rows], at,
                groups, budget or None, options,
            )  # fmt: skip
            logprobs.append(stats[..., 0])
            entropies.append(stats[..., 1] if with_entropy else None)
            continue
        if use_lean:
            stats = _lean_logprobs(
                model, prompt_ids[rows], prompt_mask[rows], labels, at, temperature, with_entropy, chunk_size, groups
            )
            logprobs.append(stats[..., 0])
            entropies.append(stats[..., 1] if with_entropy else None)
            continue
        input_ids = torch.cat([prompt_ids[rows], completion_ids[rows]], dim=1)
        attention = torch.cat([prompt_mask[rows], completion_mask[rows]], dim=1)
        hooks = nullcontext({"fired": False})
        if layer is not None:
            hooks = _logprobs_as_logits(
                layer,
                labels.flatten().index_select(0, at),
                _pick_padded(labels, at),
                _placed_padded(labels, at),
                **options,
            )
        with hooks as state:
            # use_cache=False: a training forward has no use for a KV cache, and building one costs memory.
            # The micro-batch's own rows' inputs and their positions (text: positions over the real tokens).
            row_inputs = vision[rows] if vision is not None else ()
            extra = modality.forward_inputs(model, row_inputs, input_ids, attention, prompt_width=prompt_ids.size(1))
            output = model(
                input_ids=input_ids,
                attention_mask=attention,
                **extra,
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
