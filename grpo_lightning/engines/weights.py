"""The policy's weights as a plain Hugging Face model has them, for an engine that holds its own copy (vLLM).

One tensor at a time, under its Hugging Face name: LoRA adapters merged into their layer's weight (never into the
trainer's model), FSDP2 shards gathered as each one is taken (never the whole model at once).

PEFT renames what it wraps, and none of its names may leave the trainer: a LoRA layer's weight is
``<layer>.base_layer.weight`` (sent as ``<layer>.weight``, the adapter merged in), and a layer trained in full
beside the adapters (``model.lora.modules_to_save``) holds two copies, ``<layer>.original_module.*`` (the frozen
base, never sent) and ``<layer>.modules_to_save.<adapter>.*`` (the trained one, sent as ``<layer>.*``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from grpo_lightning.lora import is_peft_model


def _full(tensor: Tensor) -> Tensor:
    """A parameter's full value: FSDP2 shards (DTensors) are gathered, on every rank (a collective)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _size(tensor: Tensor) -> tuple[int, ...]:
    return tuple(tensor.size() if hasattr(tensor, "full_tensor") else tensor.shape)


def _wrapped_copies(base: nn.Module) -> dict[str, str | None]:
    """``{path of a modules_to_save wrapper: its active adapter}`` (None where no adapter of it is active: the
    wrapper then runs the original module, as PEFT's forward does)."""
    try:
        from peft.utils import ModulesToSaveWrapper
    except ImportError:  # pragma: no cover - a PEFT model implies PEFT
        return {}
    copies = {}
    for path, module in base.named_modules():
        if isinstance(module, ModulesToSaveWrapper):
            active = [a for a in module.active_adapters if a in module.modules_to_save]
            copies[path] = active[0] if active and not module.disable_adapters else None
    return copies


def _plain_names(policy: nn.Module) -> Iterator[tuple[str, str, Tensor, nn.Module | None]]:
    """``(plain name, state-dict key, tensor, LoRA layer or None)`` for every weight a plain model has, in the
    base model's order: PEFT's names mapped back (module docstring); adapters and unused copies left out."""
    if any(hasattr(p, "ds_id") for p in policy.parameters()):  # refused before training (config_checks.py)
        raise RuntimeError("DeepSpeed ZeRO-3 weights are partitioned: they cannot leave the trainer one by one")
    if not is_peft_model(policy):
        for key, tensor in policy.state_dict().items():
            yield key, key, tensor, None
        return
    from peft.tuners.lora import LoraLayer

    base = policy.get_base_model()
    layers = {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    copies = _wrapped_copies(base)
    for key, tensor in base.state_dict().items():
        wrapper = next((path for path in copies if key.startswith(f"{path}.")), None)
        name = key
        if wrapper is not None:
            rest = key[len(wrapper) + 1 :]
            active = copies[wrapper]
            if active is None and rest.startswith("original_module."):
                name = f"{wrapper}.{rest.removeprefix('original_module.')}"
            elif active is not None and rest.startswith(f"modules_to_save.{active}."):
                name = f"{wrapper}.{rest.removeprefix(f'modules_to_save.{active}.')}"
            else:
                continue  # the frozen original (or another adapter's copy): not what the policy runs
        owner = next((layer for layer in layers if name.startswith(f"{layer}.")), None)
        if owner is None:
            yield name, key, tensor, None
        elif name == f"{owner}.base_layer.weight":
            yield f"{owner}.weight", key, tensor, layers[owner]
        elif name == f"{owner}.base_layer.bias":
            yield f"{owner}.bias", key, tensor, None


@torch.no_grad()
def policy_weights(policy: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(Hugging Face name, tensor)`` of every weight of the policy as a plain model, one at a time.

    LoRA adapters are merged into their layer's weight (W + scale·B·A, peft's own ``get_delta_weight``) without
    copying the model; a ``modules_to_save`` layer is its trained copy under the base model's name. Tied weights
    (``lm_head`` = ``embed_tokens``) are both yielded: vLLM's CPU backend rebuilds a layer's packed copy only when
    the layer is given a tensor.
    """
    for name, _, tensor, lora_layer in _plain_names(policy):
        if lora_layer is None:
            yield name, _full(tensor).detach()
        else:
            delta = sum(lora_layer.get_delta_weight(a) for a in lora_layer.active_adapters if a in lora_layer.lora_A)
            yield name, (_full(tensor) + _full(delta)).detach()


def policy_weights_shapes(policy: nn.Module) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The names and shapes ``policy_weights`` yields, without gathering or merging anything."""
    for name, _, tensor, _ in _plain_names(policy):
        yield name, _size(tensor)


def policy_weights_meta(policy: nn.Module) -> Iterator[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``(name, dtype, shape)`` of what ``policy_weights`` yields, in its order, without gathering or merging."""
    for name, _, tensor, _ in _plain_names(policy):
        yield name, tensor.dtype, _size(tensor)
