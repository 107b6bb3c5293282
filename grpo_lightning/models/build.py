"""Loading the model and tokenizer that GRPO trains: a Hugging Face model as its modality loads it
(``grpo_lightning/modality.py``), or the built-in tiny Llama.

``GRPOModule.configure_model`` composes these with the reference copy, LoRA and sharding.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_lightning.modality import TEXT, Modality, modality_for
from grpo_lightning.models.sources import (
    POLICY,
    check_model_source,
    fix_special_tokens,
    model_eos_token_id,
    model_source_error,
)
from grpo_lightning.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_llama


def model_modality(model_name_or_path: str | None, setting: str = POLICY) -> Modality:
    """The modality of the model (``grpo_lightning/modality.py: modality_for``, read from its config; text for
    the tiny Llama), a name that cannot be a model, or one that cannot be reached, refused in one line naming
    ``setting``."""
    if model_name_or_path is None:
        return TEXT
    check_model_source(model_name_or_path, setting)
    try:
        return modality_for(model_name_or_path)
    except OSError as err:  # not on the Hub, no network, a private repository: one line that names the setting
        raise model_source_error(model_name_or_path, err, setting) from err


def load_tokenizer(
    model_name_or_path: str | None, setting: str = POLICY, modality: Modality | None = None
) -> PreTrainedTokenizerBase:
    """The model's tokenizer, left-padding (generation appends on the right); the character tokenizer of the tiny
    Llama when ``model_name_or_path`` is None. A missing eos comes from the model config and a missing pad is eos
    (masked out everywhere), each with a warning. ``setting``: the config key that names the model (the policy's,
    or ``model.teacher.model_name_or_path``), for a one-line error when it cannot be loaded. ``modality``: the
    model's (``model_modality``, the default), which loads it (a vision-language model's: its processor's tokenizer,
    the processor kept by the modality)."""
    if model_name_or_path is None:
        return build_char_tokenizer()
    modality = modality if modality is not None else model_modality(model_name_or_path, setting)
    check_model_source(model_name_or_path, setting)
    try:
        tokenizer = modality.load_tokenizer(model_name_or_path)
    except OSError as err:  # not on the Hub, no network, a private repository: one line that names the setting
        raise model_source_error(model_name_or_path, err, setting) from err
    tokenizer.padding_side = "left"
    eos = model_eos_token_id(model_name_or_path) if tokenizer.eos_token is None else None
    return fix_special_tokens(tokenizer, model_name_or_path, eos, setting)


def load_model(
    model_name_or_path: str | None,
    tiny_model: TinyModelConfig,
    tokenizer: PreTrainedTokenizerBase,
    modality: Modality | None = None,
) -> PreTrainedModel:
    """The model (Hub name or local folder) as its ``modality`` loads it (a causal LM for text; a vision-language
    model's ``AutoModelForImageTextToText``; default: ``model_modality``'s), or a tiny Llama built from ``tiny_model``
    when the name is None.

    Its dtype is torch's default one: the Trainer's inside ``configure_model`` (bfloat16 under
    ``precision="bf16-true"``).
    """
    if model_name_or_path is None:
        model = build_tiny_llama(tiny_model, tokenizer)
    else:
        modality = modality if modality is not None else model_modality(model_name_or_path)
        model = modality.load_model(model_name_or_path, torch.get_default_dtype())
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


# Float attributes through which Hugging Face attention classes read their dropout probability (Llama, Qwen,
# Mistral: ``attention_dropout``; others keep an ``nn.Dropout`` module, handled by type).
_DROPOUT_ATTRIBUTES = ("attention_dropout", "attn_dropout", "dropout", "dropout_p", "hidden_dropout")
_DROPOUT_MODULES = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout probability of ``model`` to 0, in modules and in attention classes' float attributes.

    GRPO's ratio compares the update's π_θ with the π_old that sampled (in eval mode, no dropout): with dropout on
    in the update, π_θ is a different, noisy distribution and the ratio is off 1 from the first step. The model's
    config is left as it is, so an exported model keeps its dropout for later fine-tuning. Returns how many
    settings were changed.
    """
    changed = 0
    for module in model.modules():
        if isinstance(module, _DROPOUT_MODULES):
            changed += module.p != 0
            module.p = 0.0
            continue
        for name in _DROPOUT_ATTRIBUTES:
            value = getattr(module, name, None)
            if isinstance(value, float) and not isinstance(value, bool):
                changed += value != 0
                setattr(module, name, 0.0)
    return changed


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer's activations in the backward pass; the KV cache off for training forwards.

    Non-reentrant checkpointing, which needs no input that requires grad (the embeddings are frozen under LoRA).
    Generation asks for its own cache explicitly.
    """
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5 name
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
