"""The server's side of the ``checked_nccl`` weight transport: vLLM's NCCL transport (GPU servers), checked.

vLLM's own ``nccl`` engine loads each received tensor and discards what the model's loader reports, so a weight it
did not load goes unnoticed and sampling goes on from the old value. This one receives the same broadcasts (the
trainer's side is vLLM's NCCL one, unchanged: ``integrations/vllm/weight_transfer.py``, one tensor per broadcast) and
loads them as the ``gloo`` transport does, through ``vllm_loading.receive_checked``: a push that leaves any weight of
the model unloaded is refused in one line naming the first. Registered as ``checked_nccl`` by
``grpo_lightning.integrations.vllm.plugin``: start a GPU server with ``--weight-transfer-config '{"backend":
"checked_nccl"}'`` in an environment with grpo_lightning installed. Imported in the server's processes only.
"""

from __future__ import annotations

import torch
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine, NCCLWeightTransferUpdateInfo

from grpo_lightning.integrations.vllm.loading import receive_checked


class CheckedNCCLWeightTransferEngine(NCCLWeightTransferEngine):
    """vLLM's NCCL weight transfer, each push loaded and checked whole (unpacked broadcasts only: the trainer's)."""

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        if self.model_update_group is None:
            raise RuntimeError("the NCCL weight transfer is not initialised: call init_weight_transfer_engine first")
        if self.packed:
            raise ValueError("checked_nccl receives one tensor per broadcast; the trainer asked for packed ones")
        group = self.model_update_group

        def receive(weight: torch.Tensor) -> torch.Tensor:
            weight = weight.to(self.device)
            group.broadcast(weight, src=0, stream=torch.cuda.current_stream())
            return weight

        receive_checked(self, update_info.names, update_info.dtype_names, update_info.shapes, receive)
