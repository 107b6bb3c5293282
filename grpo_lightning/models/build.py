"""Loading the model and tokenizer that GRPO trains: a Hugging Face causal LM, or the built-in tiny Llama.

``GRPOModule.configure_model`` composes these with the reference copy, LoRA and sharding.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from grpo_lightning.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_llama
from grpo_lightning.validation import fix_special_tokens, model_eos_token_id


def load_tokenizer(model_name_or_path: str | None) -> PreTrainedTokenizerBase:
    """The model's tokenizer, left-padding (generation appends on the right); the character tokenizer of the tiny
    Llama when ``model_name_or_path`` is None. A missing eos comes from the model config and a missing pad is eos
    (masked out everywhere), each with a warning."""
    if model_name_or_path is None:
        return build_char_tokenizer()
    tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
    tokenizer.padding_side = "left"
    eos = model_eos_token_id(model_name_or_path) if tokenizer.eos_token is None else None
    return fix_special_tokens(tokenizer, model_name_or_path, eos)


def load_model(
    model_name_or_path: str | None, tiny_model: TinyModelConfig, tokenizer: PreTrainedTokenizerBase
) -> PreTrainedModel:
    """The causal LM (Hub name or local folder), or a tiny Llama built from ``tiny_model`` when the name is None.

    Its dtype is torch's default one: the Trainer's inside ``configure_model`` (bfloat16 under
    ``precision="bf16-true"``).
    """
    if model_name_or_path is None:
        model = build_tiny_llama(tiny_model, tokenizer)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_name_or_path, dtype=torch.get_default_dtype())
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


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
