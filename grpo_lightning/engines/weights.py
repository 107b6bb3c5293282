"""The policy's weights as a plain Hugging Face model has them, for an engine that holds its own copy (vLLM).

One tensor at a time, under its Hugging Face name: LoRA adapters merged into their layer's weight (never into the
trainer's model), FSDP2 shards gathered as each one is taken (never the whole model at once).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from grpo_lightning.lora import is_peft_model


def _full(tensor: Tensor) -> Tensor:
    """A parameter's full value: FSDP2 shards (DTensors) are gathered, on every rank (a collective)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


@torch.no_grad()
def policy_weights(policy: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(Hugging Face name, tensor)`` of every weight of the policy as a plain model, one at a time.

    LoRA adapters are merged into their layer's weight (W + scale·B·A, peft's own ``get_delta_weight``) without
    copying the model. Tied weights (``lm_head`` = ``embed_tokens``) are both yielded: vLLM's CPU backend rebuilds
    a layer's packed copy only when the layer is given a tensor.
    """
    if not is_peft_model(policy):
        for name, tensor in policy.state_dict().items():
            yield name, _full(tensor).detach()
        return
    from peft.tuners.lora import LoraLayer

    base = policy.get_base_model()
    layers = {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    for name, tensor in base.state_dict().items():
        owner = next((layer for layer in layers if name.startswith(f"{layer}.")), None)
        if owner is None:
            yield name, _full(tensor).detach()
        elif name == f"{owner}.base_layer.weight":
            module = layers[owner]
            delta = sum(module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A)
            yield f"{owner}.weight", (_full(tensor) + _full(delta)).detach()
        elif name == f"{owner}.base_layer.bias":
            yield f"{owner}.bias", _full(tensor).detach()


def policy_weights_shapes(policy: nn.Module) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The names and shapes ``policy_weights`` yields, without gathering or merging anything."""
    base = policy.get_base_model() if is_peft_model(policy) else policy
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        name = name.replace(".base_layer.", ".")
        shape = tensor.shape if not hasattr(tensor, "full_tensor") else tensor.size()
        yield name, tuple(shape)


def policy_weights_meta(policy: nn.Module) -> Iterator[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``(name, dtype, shape)`` of what ``policy_weights`` yields, in its order, without gathering or merging."""
    base = policy.get_base_model() if is_peft_model(policy) else policy
    dtypes = {name.replace(".base_layer.", "."): tensor.dtype for name, tensor in base.state_dict().items()}
    for name, shape in policy_weights_shapes(policy):
        yield name, dtypes[name], shape
