"""The trained model as both LightningModules build it: policy (and reference), and the context it samples in.

``build_policy`` composes ``models/build.py``'s loading with what a run's settings ask for, in the order that
matters: the reference copied from the untouched policy, activation checkpointing, LoRA, dropout off (after LoRA,
so that the adapters' dropout goes too), then FSDP2 sharding of both. ``GRPOModule`` and ``SFTModule`` call it
from ``configure_model``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from transformers import PreTrainedModel

from grpo_lightning.config import ConfigError
from grpo_lightning.lora import LoraConfig, apply_lora
from grpo_lightning.modality import Modality
from grpo_lightning.models.build import disable_dropout, enable_activation_checkpointing, load_model, model_modality
from grpo_lightning.models.sources import config_context_length
from grpo_lightning.models.tiny import TinyModelConfig
from grpo_lightning.strategies import broadcast_module, gathered, shard_model


def build_policy(
    name: str | None,
    tiny_model: TinyModelConfig,
    tokenizer: Any,
    *,
    trainer: Any = None,
    mesh: Any = None,
    reference: bool = False,
    no_dropout: bool = True,
    gradient_checkpointing: bool = False,
    lora: LoraConfig | None = None,
    freeze_vision_tower: bool = True,
    modality: Modality | None = None,
) -> tuple[PreTrainedModel, PreTrainedModel | None]:
    """``(policy, reference)``: the model to train, in train mode, and a frozen copy of it when ``reference``.

    With LoRA no copy is made (the reference is the policy with its adapter disabled). Under
    ``ModelParallelStrategy`` (``mesh`` set) both are sharded with FSDP2: each decoder layer, then the root.
    ``modality``: the model's (``grpo_lightning/modality.py``; default: read from its config,
    ``model_modality``), which loads it; ``freeze_vision_tower``: what the
    modality freezes does not train (a vision-language model's vision encoder, ``Modality.freeze``).
    """
    zero3 = bool(getattr(trainer.strategy, "zero_stage_3", False)) if trainer is not None else False
    modality = modality if modality is not None else model_modality(name)
    policy = load_model(name, tiny_model, tokenizer, modality)
    if freeze_vision_tower:
        modality.freeze(policy)
    if mesh is not None and name is None:
        broadcast_module(policy)  # random weights: every rank must shard the same model
    ref = None
    if reference and lora is None:
        # Under ZeRO-3 the weights are partitioned as they are created, and a partitioned model cannot be
        # deep-copied: the reference is loaded a second time instead.
        if zero3 and name is None:
            raise ConfigError("DeepSpeed ZeRO-3 with model.objective.beta > 0 needs model.model_name_or_path")
        ref = load_model(name, tiny_model, tokenizer, modality) if zero3 else copy.deepcopy(policy)
        ref.eval().requires_grad_(False)
    if gradient_checkpointing:
        enable_activation_checkpointing(policy)
    if lora is not None:  # what the modality froze gets no adapters (a vision tower: Modality.lora_exclude)
        policy = apply_lora(policy, lora, exclude=modality.lora_exclude(freeze_vision_tower))
        if mesh is not None:
            broadcast_module(policy, trainable_only=True)  # adapters start random on every rank
    if no_dropout:
        # After LoRA: PEFT's ``lora_dropout`` modules (model.lora.dropout) would otherwise drop in the update (train
        # mode) and not in the sampler and π_old (eval mode), and the on-policy ratio would be off 1.
        for model in (policy, ref):
            if model is not None:
                disable_dropout(model)
    policy.train()  # from_pretrained returns eval mode; the update runs in train mode
    if mesh is not None:
        mp_policy = None
        if trainer is not None and trainer.precision == "bf16-mixed":
            from torch.distributed.fsdp import MixedPrecisionPolicy

            # Compute (and all-gather) in bf16 as autocast would, reduce gradients in float32.
            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        shard_model(policy, mesh, mp_policy=mp_policy, modality=modality)
        if ref is not None:
            shard_model(ref, mesh, mp_policy=mp_policy, modality=modality)
    return policy, ref


@contextlib.contextmanager
def sampling_context(trainer: Any, policy: torch.nn.Module | None) -> Iterator[None]:
    """What generation (and rollout log-prob passes) run in: the Trainer's precision (autocast under
    ``bf16-mixed``, as in ``training_step``) and the policy's full weights, gathered once (FSDP2, ZeRO-3)."""
    precision = trainer.precision_plugin.forward_context() if trainer is not None else contextlib.nullcontext()
    with precision, gathered(policy):
        yield


def attached_trainer(module: Any) -> Any:
    """The Trainer ``module`` is attached to, or None (Lightning's ``module.trainer`` raises when there is none)."""
    try:
        return module.trainer
    except RuntimeError:
        return None


def context_length(name: str | None, tiny_model: TinyModelConfig) -> int | None:
    """The longest sequence (prompt + completion) the model supports, from its config; None when unknown."""
    if name is None:
        return tiny_model.max_position_embeddings
    from transformers import AutoConfig

    try:
        return config_context_length(AutoConfig.from_pretrained(name))
    except Exception:  # unreadable here; loading the model reports the problem in its own words
        return None
