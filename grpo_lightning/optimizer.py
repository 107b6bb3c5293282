"""The GRPO update's optimizer: AdamW over the parameters that train, fused where Lightning can still clip.

Under FSDP2 the parameters are the rank's shards (DTensors), so the optimizer state is sharded too. Plain CPU and
CUDA tensors get the fused implementation (one kernel for all parameters, as TRL's default ``optim``) wherever
Lightning can clip its gradients. Lightning's AMP plugin (``16-mixed``, ``bf16-mixed``) refuses to clip for an
optimizer that unscales gradients inside its step, as the fused one does, whatever the device: with
``trainer.gradient_clip_val`` set under AMP, torch's default implementation is used instead (``foreach`` on CUDA,
the same arithmetic; the optimizer step is a small part of a round). DeepSpeed brings its own.
"""

from __future__ import annotations

from typing import Any

import torch


def adamw_with_warmup(
    params: list[torch.nn.Parameter], trainer: Any, *, lr: float, weight_decay: float, warmup_steps: int
) -> dict[str, Any]:
    """``configure_optimizers``' answer: AdamW over ``params`` and a linear warm-up over ``warmup_steps`` steps."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    deepspeed = hasattr(trainer.strategy, "zero_stage_3") if trainer is not None else False
    amp_clipping = (
        trainer is not None and bool(trainer.gradient_clip_val) and isinstance(trainer.precision_plugin, MixedPrecision)
    )
    fused = (
        not deepspeed
        and not amp_clipping
        and all(type(p) is torch.nn.Parameter and p.device.type in ("cpu", "cuda") for p in params)
    )
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup_steps + 1)))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
