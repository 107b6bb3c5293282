"""Per-row image inputs: each prompt's processor outputs beyond its token ids, kept apart and joined per forward.

The processor is run on one prompt at a time (``integrations/vision/encoder.py``), so what it returns besides the ids
belongs to that prompt alone: ``pixel_values`` and ``image_grid_thw`` (Qwen2-VL: one row per patch, one grid per image),
``pixel_values`` (LLaVA: one row per image), ``pixel_values`` and ``pixel_attention_mask`` (Idefics3 / SmolVLM:
``[1, tiles, ...]``), ``image_sizes``, ... A rollout keeps one such dict per row (``RolloutBatch.vision``), selects
and repeats them with the rows, and every forward (generation, π_old, π_ref, the update) joins those of its own
rows (``forward_inputs``). A row's inputs never depend on which rows share its micro-batch, so neither do its
log-probs.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpo_lightning.integrations.vision.vllm_inputs import image_token_id
from grpo_lightning.models.lean_forward import mask_positions

log = logging.getLogger(__name__)

VisionRow = dict[str, Tensor]
"""One prompt's image inputs (empty for a text-only prompt), on the CPU until a forward joins them."""

# The processor's outputs that are the text's own, one value per token: made again from the joined ids where the
# model reads them (``token_inputs``), or not model inputs (PaliGemma's processor returns ``labels``).
TEXT_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids", "labels")

# How a model whose forward reads ``token_type_ids`` reads them, by its config's ``model_type``. Gemma 3: 1 at each
# image's tokens, which attend to each other both ways (0 elsewhere, a completion's tokens included: what its
# ``generate()`` carries on). PaliGemma: a prefix language model: 0 over the prompt (its prefix, attended both
# ways, its images among it), 1 after it (the causal suffix: the tokens its ``generate()`` appends, a completion).
# A model that reads them by another rule is refused (``check_model_inputs``).
TOKEN_TYPE_RULES = {"gemma3": "images", "paligemma": "prefix"}


@functools.cache
def packing_off(pack_tokens: int | str) -> None:
    """Say once (per process and setting) that ``data.update.pack_tokens`` does not pack a vision-language model's rows:
    its forward places each row's image features by the row's placeholders, which a packed bin would mix."""
    log.warning("data.update.pack_tokens: %s is off for a vision-language model: its rows run padded", pack_tokens)


def row_inputs(output: Mapping[str, Any]) -> VisionRow:
    """The image inputs of a one-prompt processor ``output`` (a copy, on the CPU)."""
    return {
        name: value.detach().to("cpu").clone()
        for name, value in output.items()
        if isinstance(value, Tensor) and name not in TEXT_KEYS
    }


def _per_prompt(name: str, value: Tensor) -> bool:
    """Whether ``value`` is laid out ``[prompts, images or tiles, ...]`` (Idefics3 / SmolVLM's tiles and their
    pixel mask); every other image input is laid out one row per image or patch."""
    return name == "pixel_attention_mask" or (name == "pixel_values" and value.dim() == 5)


def join_rows(rows: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """The image inputs of ``rows`` as one forward takes them, in row order (rows without images add nothing).

    Inputs laid out one row per image or patch are concatenated. Tiles (``[1, tiles, C, H, W]`` and their
    ``[1, tiles, H, W]`` masks) are put in one run of tiles, padded to the largest height and width with zeros
    (the mask False there): the model flattens prompts × tiles and drops all-zero tiles, so this is the layout the
    processor itself makes for a batch, without its all-zero padding tiles.
    """
    names = list(dict.fromkeys(name for row in rows for name in row))
    joined = {}
    for name in names:
        values = [row[name] for row in rows if name in row]
        if _per_prompt(name, values[0]):
            joined[name] = torch.cat(_padded_tiles(values), dim=1)
        else:
            joined[name] = torch.cat(values, dim=0)
    return joined


def _padded_tiles(values: list[Tensor]) -> list[Tensor]:
    height = max(v.size(-2) for v in values)
    width = max(v.size(-1) for v in values)
    return [F.pad(v, (0, width - v.size(-1), 0, height - v.size(-2))) for v in values]


def repeat_rows(rows: Sequence[VisionRow], times: int) -> list[VisionRow]:
    """Each row's inputs ``times`` times in a row (the G completions of a prompt share its images)."""
    return [row for row in rows for _ in range(times)]


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper (or ``model`` itself)."""
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model


def placeholder_token_ids(model: nn.Module) -> list[int]:
    """The ids the model reads as image (or video) placeholders: a completion must never hold them, or the next
    forward would look for an image they stand for (a trained model never writes them; a random tiny one would)."""
    config = base_model(model).config
    names = ("image_token_id", "image_token_index", "video_token_id")
    return sorted({value for name in names if isinstance(value := getattr(config, name, None), int)})


def check_completions(model: nn.Module, completion_ids: Tensor, completion_mask: Tensor) -> None:
    """Refuse completions that hold an image placeholder (``placeholder_token_ids``): the forward would look for an
    image for it and fail far from the cause (or, in ``get_rope_index``, end the round's iteration silently)."""
    ids = torch.tensor(placeholder_token_ids(model), device=completion_ids.device)
    found = torch.isin(completion_ids, ids) & completion_mask.bool()
    if bool(found.any()):
        row = int(found.any(-1).nonzero()[0])
        raise ValueError(
            f"completion row {row} holds an image placeholder token: the engine must not sample one "
            "(TransformersEngine suppresses them for a vision-language model)"
        )


def token_type_rule(model_type: str | None) -> str | None:
    """``TOKEN_TYPE_RULES``' rule of a ``model_type`` (``images`` or ``prefix``), None for a model not listed."""
    return TOKEN_TYPE_RULES.get(model_type or "")


def token_types(config: Any, input_ids: Tensor, prompt_width: int) -> Tensor:
    """``token_type_ids`` of ``input_ids`` (left-padded prompts of ``prompt_width`` columns, then what follows them)
    as the processor and ``generate()`` of the model of ``config`` give them (``TOKEN_TYPE_RULES``)."""
    model_type = getattr(config, "model_type", None)
    rule = token_type_rule(model_type)
    if rule == "images":
        return (input_ids == image_token_id(config)).long()
    if rule == "prefix":
        return (torch.arange(input_ids.size(1), device=input_ids.device) >= prompt_width).long().expand_as(input_ids)
    raise ValueError(f"{model_type} reads token_type_ids by a rule grpo_lightning does not know")


def modality_types(config: Any, input_ids: Tensor) -> Tensor:
    """``mm_token_type_ids`` of ``input_ids`` for the model of ``config``: 1 at image tokens, 2 at video tokens, 0
    elsewhere."""
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    for value, name in ((1, "image_token_id"), (2, "video_token_id")):
        token = getattr(config, name, None)
        if token is not None:
            types[input_ids == token] = value
    return types


def config_token_inputs(
    config: Any, parameters: Collection[str], input_ids: Tensor, prompt_width: int
) -> dict[str, Tensor]:
    """The per-token inputs the processor of the model of ``config`` makes beside the ids, made again for
    ``input_ids`` (left-padded prompts of ``prompt_width`` columns, then what follows them): those its forward reads
    (``parameters``) of the modality of each token (``mm_token_type_ids``) and ``token_type_ids``
    (``token_types``)."""
    inputs = {}
    if "mm_token_type_ids" in parameters:
        inputs["mm_token_type_ids"] = modality_types(config, input_ids)
    if "token_type_ids" in parameters:
        inputs["token_type_ids"] = token_types(config, input_ids, prompt_width)
    return inputs


def token_inputs(model: nn.Module, input_ids: Tensor, prompt_width: int) -> dict[str, Tensor]:
    """``config_token_inputs`` of ``model``: one function for every pass and ``generate()``, so that none of them
    runs without an input another one has (``integrations/vision/model_inputs.py`` checks them against the processor's
    own)."""
    base = base_model(model)
    return config_token_inputs(base.config, inspect.signature(base.forward).parameters, input_ids, prompt_width)


def generation_inputs(model: nn.Module, rows: Sequence[Mapping[str, Tensor]], input_ids: Tensor) -> dict[str, Tensor]:
    """What ``model.generate`` takes besides the ids and mask of ``rows`` (left-padded prompts ``input_ids``): their
    joined image inputs on the model's device and float dtype, and the per-token inputs the model reads
    (``token_inputs``; ``generate`` finds the positions itself, and carries the token types on to what it adds)."""
    return {**_image_inputs(model, rows, input_ids.device), **token_inputs(model, input_ids, input_ids.size(1))}


def _image_inputs(model: nn.Module, rows: Sequence[Mapping[str, Tensor]], device: torch.device) -> dict[str, Tensor]:
    """``rows``' joined image inputs on ``device``, floating ones in the model's dtype."""
    dtype = next(model.parameters()).dtype
    return {
        name: value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
        for name, value in join_rows(rows).items()
    }


def forward_inputs(
    model: nn.Module,
    rows: Sequence[Mapping[str, Tensor]],
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    prompt_width: int,
) -> dict[str, Tensor]:
    """What a forward of ``model`` over ``input_ids`` (left-padded prompts of ``prompt_width`` columns, ``rows``'
    image inputs, then their completions) takes besides the ids and mask: the joined image inputs on the model's
    device and float dtype, the per-token inputs the model reads (``token_inputs``), and its position ids.

    Positions: the Qwen-VL family's 3-D M-RoPE ones from its own ``get_rope_index`` (text positions count real
    tokens only, so left padding moves nothing; the model's default would count from the padded start on a
    text-only row), others' counted over the real tokens (``attention_mask``'s cumulative sum), as the text
    path does.
    """
    base = base_model(model)
    inputs = {**_image_inputs(model, rows, input_ids.device), **token_inputs(model, input_ids, prompt_width)}
    rope_index = getattr(getattr(base, "model", base), "get_rope_index", None)
    if callable(rope_index) and "mm_token_type_ids" in inputs and "video_grid_thw" not in inputs:
        types = inputs["mm_token_type_ids"]
        inputs["position_ids"] = mrope_positions(rope_index, rows, input_ids, types, attention_mask)
    elif callable(rope_index) and "mm_token_type_ids" in inputs:
        inputs["position_ids"] = rope_index(
            input_ids,
            mm_token_type_ids=inputs["mm_token_type_ids"],
            image_grid_thw=inputs.get("image_grid_thw"),
            video_grid_thw=inputs.get("video_grid_thw"),
            attention_mask=attention_mask,
        )[0]
    else:
        inputs["position_ids"] = mask_positions(attention_mask)
    return inputs


def mrope_positions(
    rope_index: Any, rows: Sequence[Mapping[str, Tensor]], input_ids: Tensor, types: Tensor, attention_mask: Tensor
) -> Tensor:
    """The Qwen-VL family's 3-D positions of ``input_ids`` (left-padded rows with images, no video), equal to
    ``rope_index`` (the model's ``get_rope_index``) over the whole batch, for a fraction of its cost: it is a Python
    loop over every row and every run of tokens, and the G rows of a prompt share everything up to their last image.
    So it runs once per distinct head (the real tokens up to the last image token, and that row's image grids), with
    one text token after it; a row's later tokens are text, whose positions count on from that token's by one
    (the rule of ``get_rope_index`` after an image, whatever the model's), and a text-only row's count from 0.
    Padding gets 0, as ``get_rope_index`` gives it. Rows whose real tokens are not one run (never in a padded batch
    of prompt + completion) go through ``rope_index`` itself."""
    batch, length = input_ids.shape
    columns = torch.arange(length, device=input_ids.device)
    real = attention_mask.bool()
    first = torch.where(real.any(1), real.int().argmax(1), 0)
    end = first + real.sum(1)
    if not torch.equal((real * (columns + 1)).amax(1), torch.where(real.any(1), end, 0)):  # not one run per row
        grids = [row["image_grid_thw"] for row in rows if "image_grid_thw" in row]
        grid = torch.cat(grids).to(input_ids.device) if grids else None
        return rope_index(input_ids, mm_token_type_ids=types, image_grid_thw=grid, attention_mask=attention_mask)[0]
    vision = types != 0
    cut = torch.where(vision.any(1), (vision * (columns + 1)).amax(1), first)  # one past the last image token
    positions = torch.zeros(3, batch, length, dtype=input_ids.dtype, device=input_ids.device)
    starts = torch.zeros(3, batch, dtype=input_ids.dtype, device=input_ids.device)
    heads: dict[tuple, tuple[Tensor, Tensor]] = {}
    ids, first_at, cut_at = input_ids.cpu().numpy(), first.tolist(), cut.tolist()
    for index, row in enumerate(rows):
        f, c = first_at[index], cut_at[index]
        if c == f:  # text only: positions count from 0 on every axis
            continue
        grid = row.get("image_grid_thw")
        key = (ids[index, f : c + 1].tobytes(), None if grid is None else grid.cpu().numpy().tobytes())
        if key not in heads:
            head_ids, head_types = input_ids[index, f : c + 1], types[index, f : c + 1]
            heads[key] = _head_positions(rope_index, head_ids, head_types, grid, c - f)
        head, start = heads[key]
        positions[:, index, f:c] = head
        starts[:, index] = start
    tail = starts.unsqueeze(-1) + (columns.view(1, 1, -1) - cut.view(1, -1, 1))
    in_tail = (columns.view(1, -1) >= cut.view(-1, 1)) & (columns.view(1, -1) < end.view(-1, 1))
    return torch.where(in_tail.unsqueeze(0), tail, positions)


def _head_positions(
    rope_index: Any, ids: Tensor, kinds: Tensor, grid: Tensor | None, cut: int
) -> tuple[Tensor, Tensor]:
    """``rope_index``'s positions of a row's first ``cut`` tokens (through its last image) and the first text token's
    after them (``ids`` holds it, when the row has one; else its position is never used)."""
    grid = grid.to(ids.device) if grid is not None else None
    out = rope_index(ids.view(1, -1), mm_token_type_ids=kinds.view(1, -1), image_grid_thw=grid)[0][:, 0]
    start = out[:, cut] if out.shape[1] > cut else out[:, cut - 1] + 1
    return out[:, :cut], start
