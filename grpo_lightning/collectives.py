"""What ranks exchange outside the model's own collectives: every rank's copy of a small value.

The round's collector (each rank's names of an environment's metrics), the DataModule (each rank's prompt
position), the module (each rank's round metrics) and the checkpoint (each rank's RNG states) keep state per rank;
``gather_per_rank`` brings every rank's copy to every rank, in rank order. Not a sharding concern, so not in
``strategies.py``: it runs the same under DDP, FSDP2 and DeepSpeed.
"""

from __future__ import annotations

from typing import Any

import torch


def gather_per_rank(trainer: Any, value: Any) -> list[Any]:
    """``value`` of every rank, in rank order (a collective under data parallelism: call it on every rank);
    ``[value]`` in a single process. For small picklable state (positions, RNG states), not for tensors."""
    world = trainer.world_size if trainer is not None else 1
    if world == 1 or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return [value]
    gathered_values: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered_values, value)
    return gathered_values
