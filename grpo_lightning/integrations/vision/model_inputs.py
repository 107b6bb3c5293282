"""Whether every processor output a vision-language model's forward reads reaches it, checked when it loads; whether
two processors (a student's and its teacher's) encode an image prompt alike.

The processor runs on one prompt at a time (``integrations/vision/encoder.py``); of what it returns, the inputs laid out
per image (pixels, grids, tile masks, sizes) travel with each row and are joined per forward
(``integrations/vision/inputs.py: join_rows``), and the inputs laid out per token are made again from each forward's ids
(``token_inputs``: the modality of each token, Gemma 3's and PaliGemma's ``token_type_ids``). Any other output the
model's forward reads would be dropped in every pass (π_old, π_ref, the update, the teacher, SFT) and in ``generate()``,
and the model would run on other inputs than its own forward's, silently: such a model is refused in one line before it
loads.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import Tensor

from grpo_lightning.config import ConfigError
from grpo_lightning.integrations.vision.images import pil_image
from grpo_lightning.integrations.vision.inputs import config_token_inputs, token_type_rule

# The processor's outputs every pass has without this check: the ids and mask themselves, and labels (no input).
_NOT_INPUTS = ("input_ids", "attention_mask", "labels")
_PROBE_TEXTS = ("How many?", "How many shapes are in this picture, counted one by one?")


@functools.cache
def forward_parameters(model_type: str | None) -> frozenset[str] | None:
    """The parameters of the forward of ``AutoModelForImageTextToText``'s class for ``model_type`` (None when
    transformers maps it to no class it exports)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type)
    model_class = getattr(transformers, name, None) if isinstance(name, str) else None
    return None if model_class is None else frozenset(inspect.signature(model_class.forward).parameters)


def check_model_inputs(name: str, config: Any, processor: Any) -> None:
    """Refuse (``ConfigError``, naming ``model.model_name_or_path``) a model (of ``config``) whose forward reads a
    processor output that the passes do not give it as the processor does: one laid out per token other than those
    made again from the ids, one of those (``integrations/vision/inputs.py: config_token_inputs``:
    ``mm_token_type_ids``, ``token_type_ids`` by ``TOKEN_TYPE_RULES``) that the ids do not give back, or an output that
    is not a tensor. The processor runs on two probe prompts (one blank image, texts of two lengths): an output whose
    shape follows the text's length is laid out per token."""
    model_type = getattr(config, "model_type", None)
    parameters = forward_parameters(model_type)
    short, long = (_probe(processor, text) for text in _PROBE_TEXTS)
    if parameters is None or short is None or long is None:
        return  # no class to read, or no chat template (the prompt encoder refuses that itself)
    ids = short["input_ids"]
    for key, value in short.items():
        if key not in parameters or key in _NOT_INPUTS:
            continue
        if key == "token_type_ids" and token_type_rule(model_type) is None:
            how = f"by a rule grpo_lightning does not know (model_type {model_type})"
        elif key in ("mm_token_type_ids", "token_type_ids"):
            if torch.equal(config_token_inputs(config, (key,), ids, ids.size(1))[key].long(), value.long()):
                continue
            how = "which its ids do not give back as grpo_lightning makes them again for each pass"
        elif not isinstance(value, Tensor):
            how = "which is not a tensor"
        elif value.shape != long[key].shape:
            how = "one value per token, which grpo_lightning does not make again for each pass"
        else:
            continue
        raise ConfigError(
            f"model.model_name_or_path {name!r}: its forward reads the processor's {key!r}, {how}: every pass "
            "would run the model on other inputs than its own forward's; this model is not supported yet"
        )


def same_encoding(student: Any, teacher: Any) -> str | None:
    """How ``teacher``'s processor encodes an image prompt otherwise than ``student``'s (the prompt rendered with the
    student's chat template, two images of other sizes and content), or None when every output is equal: a teacher
    given the student's ids and image inputs then reads what its own processor would have given it."""
    pil = pil_image()
    images = [pil.linear_gradient("L").convert("RGB").resize(size) for size in ((84, 56), (56, 112))]
    ours, theirs = (_probe(processor, _PROBE_TEXTS[1], images, renderer=student) for processor in (student, teacher))
    if ours is None or theirs is None:
        return None
    for key in sorted(ours.keys() | theirs.keys()):
        mine, other = ours.get(key), theirs.get(key)
        if mine is None or other is None:
            return f"{key!r} from one processor only"
        if isinstance(mine, Tensor) and isinstance(other, Tensor):
            if mine.shape != other.shape or not torch.equal(mine, other.to(mine.dtype)):
                return f"another {key!r}"
        elif mine != other:
            return f"another {key!r}"
    return None


def _probe(processor: Any, text: str, images: list[Any] | None = None, renderer: Any = None) -> dict[str, Any] | None:
    """The processor's outputs for a prompt of ``images`` (one blank image by default), then ``text``, rendered with
    ``renderer``'s chat template (the processor's own by default; None: no template)."""
    renderer = renderer if renderer is not None else processor
    renderer = renderer if getattr(renderer, "chat_template", None) else renderer.tokenizer
    if not getattr(renderer, "chat_template", None):
        return None
    images = images if images is not None else [pil_image().new("RGB", (56, 56), "white")]
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": text}]
    rendered = renderer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return dict(processor(text=[rendered], images=[images], return_tensors="pt", add_special_tokens=False))
