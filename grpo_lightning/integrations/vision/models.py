"""Which models are vision-language ones, how they load, and their vision tower frozen.

A ``model.model_name_or_path`` whose config names an architecture of ``AutoModelForImageTextToText`` (and has a
``vision_config``) loads with it, and its tokenizer is its processor's (``integrations/vision/processors.py``). The
processor is the image modality's (``integrations/vision/modality.py``), which every consumer is given with the policy.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

from torch import nn

log = logging.getLogger(__name__)

# Where transformers' image-text-to-text models keep their vision encoder (Qwen-VL: ``visual``; LLaVA, Gemma 3:
# ``vision_tower``; Idefics3, SmolVLM: ``vision_model``), on the inner model or the outer one.
VISION_TOWER_NAMES = ("visual", "vision_tower", "vision_model", "vision_encoder")


@functools.cache
def is_vision_model(name: str | None) -> bool:
    """Whether ``name`` (a local folder or Hub name; None: the built-in tiny Llama) is a vision-language model."""
    if name is None:
        return False
    config = _config_dict(name)
    if config is None or "vision_config" not in config:
        return False
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return config.get("model_type") in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def _config_dict(name: str) -> dict[str, Any] | None:
    path = Path(name).expanduser() / "config.json"
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except ValueError:
            return None
    from transformers import AutoConfig

    # A Hub name: its config, from the cache or the Hub. An OSError (not on the Hub, no network) goes up to the
    # caller's one line (``models/build.py: load_tokenizer``): swallowed, the tokenizer's load would then wait on
    # the same unreachable Hub a second time. Anything else (a config transformers cannot read without remote
    # code) is left to the text model's loading to report.
    try:
        return AutoConfig.from_pretrained(name).to_dict()
    except OSError:
        raise
    except Exception:
        return None


@functools.cache
def vision_model_type(name: str | None) -> str | None:
    """The ``model_type`` of a vision-language model's ``name`` (``is_vision_model``), None for another model."""
    return _config_dict(name)["model_type"] if name is not None and is_vision_model(name) else None


def load_vision_processor(name: str) -> Any:
    """The model's processor, its tokenizer left-padding; a model whose forward reads a processor output the passes
    would drop is refused (``integrations/vision/model_inputs.py``)."""
    from transformers import AutoConfig

    from grpo_lightning.integrations.vision.model_inputs import check_model_inputs
    from grpo_lightning.integrations.vision.processors import load_processor

    processor = load_processor(name)
    check_model_inputs(name, AutoConfig.from_pretrained(name), processor)
    processor.tokenizer.padding_side = "left"
    return processor


def load_vision_tokenizer(name: str) -> Any:
    """``load_vision_processor``'s tokenizer (the processor is the image modality's:
    ``integrations/vision/modality.py``)."""
    return load_vision_processor(name).tokenizer


def load_vision_model(name: str, dtype: Any) -> nn.Module:
    """``AutoModelForImageTextToText.from_pretrained(name)`` in ``dtype``."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(name, dtype=dtype)


def is_vision_config(config: Any) -> bool:
    """Whether a model ``config`` (a ``PretrainedConfig``) is a vision-language model's (``is_vision_model``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return (
        getattr(config, "vision_config", None) is not None
        and getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    )


def model_from_config(config: Any, dtype: Any) -> nn.Module:
    """A randomly initialised model of ``config`` in ``dtype``: ``AutoModelForImageTextToText`` for a
    vision-language model's, ``AutoModelForCausalLM`` otherwise (the background process of ``data.schedule.rollout_lag``
    builds the policy's architecture this way, then takes its weights)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM
    return auto.from_config(config, dtype=dtype)


def vision_towers(model: nn.Module) -> list[nn.Module]:
    """The vision encoder(s) of ``model`` (under a PEFT wrapper too); the projector that maps their features into
    the language model (LLaVA's ``multi_modal_projector``, Idefics3's ``connector``) is not one of them."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    found = []
    for owner in (getattr(base, "model", None), base):
        for name in VISION_TOWER_NAMES:
            module = getattr(owner, name, None) if owner is not None else None
            if isinstance(module, nn.Module) and all(module is not seen for seen in found):
                found.append(module)
    return found


def vision_tower_pattern() -> str:
    """A regular expression of the module names inside a vision encoder (``VISION_TOWER_NAMES``): with
    ``model.lora`` and the tower frozen, its linear layers get no adapters (PEFT's ``all-linear`` would give them
    some), so LoRA trains the language model (and the projector) only."""
    return r".*\b(" + "|".join(VISION_TOWER_NAMES) + r")\..*"


def freeze_vision_tower(model: nn.Module) -> int:
    """Stop the vision encoder's weights from training (``model.freeze_vision_tower``, the default, as prime-rl
    does): the reward rarely says anything about seeing, and its gradients cost memory. Returns how many
    parameters were frozen. A vision-language model whose encoder is not found is refused: the setting would do
    nothing."""
    towers = vision_towers(model)
    if not towers:
        from grpo_lightning.config import ConfigError

        raise ConfigError(
            f"model.freeze_vision_tower: no vision encoder ({', '.join(VISION_TOWER_NAMES)}) found in "
            f"{type(model).__name__}; set it to false"
        )
    frozen = 0
    for tower in towers:
        for parameter in tower.parameters():
            frozen += parameter.numel() if parameter.requires_grad else 0
            parameter.requires_grad_(False)
    return frozen
