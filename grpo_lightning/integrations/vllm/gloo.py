"""The server's side of the ``gloo`` weight transport: a vLLM weight-transfer engine for CPU servers.

vLLM ships transports for GPUs only (NCCL, CUDA IPC, ...). This one receives the trainer's broadcasts over a gloo
process group (``weight_transfer.gloo_group``) and loads each tensor as vLLM's NCCL engine does: inside vLLM's
layerwise reload, which re-packs the CPU kernels' weights once the update is finished. Unlike that engine it then
checks what the model's loader took: a push that leaves any weight unloaded is refused, naming the first
(``integrations/vllm/loading.py``). It is registered under
the name ``gloo`` by ``grpo_lightning.integrations.vllm.plugin`` (a ``vllm.general_plugins`` entry point), so a server
started with ``--weight-transfer-config '{"backend": "gloo"}'`` in an environment with grpo_lightning installed
can take the trainer's weights. Imported in the server's processes only (it imports vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from grpo_lightning.integrations.vllm.loading import receive_checked
from grpo_lightning.integrations.vllm.weight_transfer import gloo_broadcast, gloo_group


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the trainer's group is, and this server's place in it (its workers follow ``rank_offset``)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 600.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """The weights of one push, in the order they are broadcast."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("names, dtype_names and shapes must be of one length")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives the trainer's weights over gloo and loads them in checkpoint format."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None
        self._store: Any = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        self._store, self.group = gloo_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, init_info.timeout_s
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # on the CPU: nothing to synchronise

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        """Every weight of the push, loaded as it arrives; a push that leaves any of the model's weights unloaded is
        refused with one line naming the first (``vllm_loading.py``; the trainer sends a push in one update)."""
        if self.group is None:
            raise RuntimeError("the gloo weight transfer is not initialised: call init_weight_transfer_engine first")

        def receive(weight: torch.Tensor) -> torch.Tensor:
            gloo_broadcast(self.group, weight)
            return weight.to(self.device)

        receive_checked(self, update_info.names, update_info.dtype_names, update_info.shapes, receive)

    def shutdown(self) -> None:
        self.group, self._store = None, None
