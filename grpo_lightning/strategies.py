"""Scaling out: FSDP2 sharding under Lightning's ``ModelParallelStrategy``, and full weights for rollouts.

* ``FSDP2Strategy``: ``ModelParallelStrategy`` with every process in one data-parallel (sharding) dimension, so
  ``devices: N`` alone configures it; ``GRPOModule.configure_model`` applies ``shard_model`` with its device mesh.
  It runs on CUDA with NCCL and on CPU with gloo.
* ``shard_model``: ``fully_shard`` on each decoder layer, then on the model itself (the root).
* ``gathered``: the model's full weights for the duration of a block (FSDP2: one all-gather per layer, kept until
  the block ends; DeepSpeed ZeRO-3: ``GatheredParameters``). Sampling runs a data-dependent number of decoding
  steps per rank, so it must not all-gather per step: a rank that finished early would leave the others waiting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from grpo_lightning.config import ConfigError
from grpo_lightning.modality import TEXT, Modality

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_GATHERED = "_grpo_gathered"  # set on a model while ``gathered`` holds its full weights (nested use is a no-op)


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` for pure FSDP2: all ``num_nodes × devices`` processes shard the model.

    ``ModelParallelStrategy``'s ``"auto"`` sizes give one node's devices to tensor parallelism, which GRPO's model
    does not use; here the data-parallel size defaults to the world size and the tensor-parallel size to 1.
    Checkpoints are sharded folders (one file per rank); ``tools/consolidate_fsdp.py`` turns one into a Hugging
    Face folder.
    """

    def __init__(
        self,
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int = 1,
        weights_only: bool = False,
        **kwargs: Any,
    ) -> None:
        """
        Args:
            data_parallel_size: processes that shard the model; ``auto`` = all of them.
            tensor_parallel_size: must stay 1: GRPOModule shards with FSDP2 only (a named argument, so that
                configs list this default rather than ``ModelParallelStrategy``'s ``auto``).
            weights_only: ``torch.load``'s setting for the checkpoint's ``meta.pt`` on resume. ``False`` by
                default: the saved hyperparameters hold config objects (``RewardSpec``, ...), and Lightning does not
                pass ``fit(weights_only=...)`` on to strategies that restore after setup, as this one does. Resume
                only from checkpoints you trust.
            **kwargs: the other arguments of ``ModelParallelStrategy`` (``save_distributed_checkpoint``,
                ``process_group_backend``, ``timeout``).
        """
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size, **kwargs)
        self.weights_only = weights_only

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            tensor_parallel = 1 if self._tensor_parallel_size == "auto" else self._tensor_parallel_size
            self._data_parallel_size = self.num_nodes * self.num_processes // tensor_parallel
        super().setup_environment()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's sharded load, for checkpoints without the reference model's weights.

        ``GRPOModule`` leaves the reference out of its checkpoints while it equals the starting model; a sharded
        load requests every key of the module, so the reference is detached from the module while loading and
        keeps the weights ``configure_model`` gave it.
        """
        path = Path(self.broadcast(checkpoint_path))
        weights_only = self.weights_only if weights_only is None else weights_only
        module = self.lightning_module
        ref = getattr(module, "ref", None)
        if not path.is_dir() or ref is None or _checkpoint_has(path, "state_dict.ref."):
            checkpoint = super().load_checkpoint(path, weights_only=weights_only)
        else:
            module.ref = None
            try:
                checkpoint = super().load_checkpoint(path, weights_only=weights_only)
            finally:
                module.ref = ref
        # The weights are loaded already; hooks written for single-file checkpoints still read this key.
        checkpoint.setdefault("state_dict", {})
        return checkpoint


def _checkpoint_has(path: Path, prefix: str) -> bool:
    """Whether the sharded (DCP) checkpoint at ``path`` holds a key starting with ``prefix``."""
    from torch.distributed.checkpoint import FileSystemReader

    return any(key.startswith(prefix) for key in FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh to shard over: ``mesh`` itself, or its ``data_parallel`` dimension under Lightning's 2-D mesh."""
    names = mesh.mesh_dim_names or ()
    if mesh.ndim == 1:
        return mesh
    if "tensor_parallel" in names and mesh["tensor_parallel"].size() > 1:
        raise ConfigError(
            f"GRPO shards its model with FSDP2 only, but the device mesh has tensor_parallel size "
            f"{mesh['tensor_parallel'].size()}: use grpo_lightning.strategies.FSDP2Strategy, or "
            "ModelParallelStrategy with tensor_parallel_size: 1 and data_parallel_size: <number of processes>"
        )
    return mesh["data_parallel"]


def decoder_layers(model: nn.Module, modality: Modality = TEXT) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face (or PEFT-wrapped) model: its ``_no_split_modules`` classes, but
    those inside its ``modality``'s root modules (``Modality.root_modules``: a vision-language model's vision
    blocks), which stay in the root unit: ``generate()`` runs the vision encoder before the model's own forward
    (transformers 5), and FSDP2 needs the root's forward to come first."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    tower = {id(m) for t in modality.root_modules(model) for m in t.modules()}
    layers = [m for m in model.modules() if type(m).__name__ in names and id(m) not in tower]
    if not layers:  # not a transformers model: the longest ModuleList holds the blocks
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        layers = list(max(lists, key=len)) if lists else []
    return layers


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    mp_policy: Any | None = None,
    reshard_after_forward: bool = True,
    modality: Modality = TEXT,
) -> nn.Module:
    """FSDP2: ``fully_shard`` each decoder layer (one all-gather unit per block; ``decoder_layers`` of the model's
    ``modality``), then the root (the rest).

    Weights tied between the input embedding and the output layer both belong to the root unit.
    """
    from torch.distributed.fsdp import fully_shard

    options: dict[str, Any] = {"mesh": data_parallel_mesh(mesh)}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    for layer in decoder_layers(model, modality):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(model, **options)
    return model


def broadcast_module(model: nn.Module, src: int = 0, *, trainable_only: bool = False) -> None:
    """Copy rank ``src``'s parameters (and buffers) to every rank: random initialisations must agree before
    sharding, since each rank keeps its own slice of its own copy."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    # NCCL moves CUDA tensors only, and configure_model builds the model on the CPU: go through the GPU then.
    nccl = "nccl" in str(torch.distributed.get_backend()).lower()
    with torch.no_grad():
        tensors = [p for p in model.parameters() if p.requires_grad or not trainable_only]
        if not trainable_only:
            tensors += list(model.buffers())
        for tensor in tensors:
            if nccl and tensor.device.type != "cuda":
                buffer = tensor.data.to(torch.device("cuda", torch.cuda.current_device()))
                torch.distributed.broadcast(buffer, src=src)
                tensor.data.copy_(buffer)
            else:
                torch.distributed.broadcast(tensor.data, src=src)


@contextlib.contextmanager
def gathered(model: nn.Module | None) -> Iterator[None]:
    """Full weights of a sharded ``model`` for the whole block, gathered once; a no-op when it is not sharded.

    FSDP2: every unit is unsharded up front (the same collectives on every rank) and kept unsharded across the
    block's forwards, then resharded. The block may then run a different number of forwards on each rank, but every
    rank must enter it as often as the others (held-out batches: ``rollout/held_out.py`` pads the short ranks).
    """
    if model is None or getattr(model, _GATHERED, False):
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    zero3 = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not units and not zero3:
        yield
        return
    setattr(model, _GATHERED, True)
    try:
        if zero3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(zero3):
                yield
            return
        for unit in units:
            if unit is not model:  # the root is never resharded after forward; the layers are by default
                unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        try:
            yield
        finally:
            for unit in units:
                unit.reshard()
                if unit is not model:
                    unit.set_reshard_after_forward(True, recurse=False)
    finally:
        setattr(model, _GATHERED, False)
