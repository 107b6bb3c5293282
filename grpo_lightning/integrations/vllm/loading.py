"""Inside vLLM: load a weight push and say what of vLLM's model it left unloaded (the ``vllm`` engine; servers on the
``gloo`` and ``checked_nccl`` transports).

vLLM's loaders take the trainer's Hugging Face names and rename and stack them (q, k and v into one ``qkv_proj``,
gate and up into ``gate_up_proj``). A weight they do not load is reported at WARNING at most (``reload_weights``;
the engines silence it), or not at all (what a server's transfer engine receives), and sampling goes on from the
old values. So every push is checked where the names are vLLM's:

- every parameter of vLLM's model is among those its ``load_weights`` reports loaded;
- every stacked parameter received all its parts: vLLM's layerwise reload holds a layer back until all its elements
  have arrived, so a layer still waiting when the push ends, its parts given by shard id, lacks the others;
- a pushed weight the loader refuses (a name it has no parameter for, a wrong shape) is named, with vLLM's reason.

Weights vLLM drops on purpose pass: they are none of its parameters (a tied output layer, a LLaVA tower's
``post_layernorm``, a GPTQ model's spare biases). Imported by vLLM's processes only; it imports vLLM where used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn


class _Tracked:
    """The pushed weights as vLLM reads them: the last name handed over, and whether the source itself failed (the
    trainer's own checks, which are not vLLM refusing a weight)."""

    def __init__(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        self._weights = iter(weights)
        self.last: str | None = None
        self.source_failed = False

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        return self

    def __next__(self) -> tuple[str, Tensor]:
        try:
            name, tensor = next(self._weights)
        except StopIteration:
            raise
        except BaseException:
            self.source_failed = True
            raise
        self.last = name
        return name, tensor


def load_checked(model: nn.Module, weights: Iterable[tuple[str, Tensor]], *, lora: bool = False) -> str | None:
    """Load ``weights`` into vLLM's ``model`` (inside a layerwise reload the caller began and finalises after this)
    and return, as one line, what the push left unloaded; None when it loaded every parameter.

    ``lora``: vLLM serves LoRA adapters, and its layers hold their weights under ``<layer>.base_layer``."""
    tracked = _Tracked(weights)
    try:
        loaded = model.load_weights(tracked)
    except Exception as err:  # noqa: BLE001 - whatever vLLM's loader raises, it refused the weight it was reading
        if tracked.source_failed:
            raise
        reason = " ".join(str(err).split())
        reason = reason if len(reason) <= 200 else reason[:199] + "…"
        return f"vLLM's {type(model).__name__} refused the pushed weight {tracked.last}: {reason}"
    return unloaded(model, loaded, lora=lora)


def unloaded(model: nn.Module, loaded: set[str] | None, *, lora: bool = False) -> str | None:
    """What of ``model`` a push left unloaded, given the names its ``load_weights`` reported (None: a model that
    reports none, checked for partly loaded parameters only); None when nothing."""

    def plain(name: str) -> str:  # as vLLM's own reload_weights names them
        return name.replace(".base_layer.", ".") if lora else name

    parts = {plain(name): shards for name, shards in _partly_loaded(model).items()}
    expected = [plain(name) for name, _ in model.named_parameters()]
    missing = [name for name in expected if name in parts or (loaded is not None and name not in loaded)]
    if not missing:
        return None
    first = missing[0]
    shown = f"{first} (only its {parts[first]} parts)" if first in parts else first
    return (
        f"the weight push left {shown} of vLLM's {type(model).__name__} unloaded ({len(missing)} of its "
        f"{len(expected)} weights)"
    )


def _partly_loaded(model: nn.Module) -> dict[str, str]:
    """``{parameter: the parts it received}`` for the stacked parameters that got some of their parts only: their
    layer still waits for the rest (vLLM's layerwise reload processes a layer once all its elements have arrived).
    A layer short of elements without shards is not one: an embedding's vocabulary padding is never loaded."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    parts: dict[str, dict[str, None]] = {}
    for prefix, layer in model.named_modules():
        info = get_layerwise_info(layer)
        if not info.can_load() or not 0 < info.load_numel < info.load_numel_total:
            continue
        for param, call in info.loaded_weights:
            shard = call.arguments.get("loaded_shard_id", call.arguments.get("shard_id"))
            if shard is not None:
                parts.setdefault(f"{prefix}.{param}" if prefix else param, {})[str(shard)] = None
    return {name: ", ".join(shards) for name, shards in parts.items()}


def reload_checked(worker: Any, weights_iterator: Iterable[tuple[str, Tensor]]) -> str | None:
    """On a vLLM worker (``LLM.collective_rpc``): the in-place reload of vLLM's ``reload_weights`` (layerwise, in
    checkpoint format, then the caches that hold what the old weights computed reset), keeping what the model's
    loader reports: what the push left unloaded (``load_checked``), or None."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    runner, config = worker.model_runner, worker.vllm_config
    model = runner.get_model()
    with set_current_vllm_config(config):
        initialize_layerwise_reload(model)
        try:
            problem = load_checked(model, weights_iterator, lora=config.lora_config is not None)
        finally:  # every layer back in place, loaded or not: none left waiting for the next push
            finalize_layerwise_reload(model, config.model_config)
    runner.reset_lora_state()
    runner.reset_encoder_cache()
    runner.reset_mm_cache()
    return problem


def receive_checked(
    transfer: Any,
    names: Sequence[str],
    dtype_names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    receive: Callable[[Tensor], Tensor],
) -> None:
    """A server's weight-transfer engine (``transfer``: vLLM's ``WeightTransferEngine``, inside the layerwise reload
    its ``start_weight_update`` began) receives one push, tensor by tensor in the trainer's order (``receive`` fills
    an empty tensor of the weight's dtype and shape and returns it on the model's device), and loads it checked:
    a push that leaves any of the model's weights unloaded is refused with one line naming the first
    (``load_checked``), every layer put back first so that none waits for the next push."""

    def received() -> Iterator[tuple[str, Tensor]]:
        for name, dtype_name, shape in zip(names, dtype_names, shapes, strict=True):
            yield name, receive(torch.empty(list(shape), dtype=getattr(torch, dtype_name)))

    problem = load_checked(transfer.model, received(), lora=transfer.vllm_config.lora_config is not None)
    if problem is not None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(transfer.model, transfer.model_config)
        raise ValueError(problem)
