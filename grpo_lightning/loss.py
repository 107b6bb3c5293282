"""Deprecated import path (kept for one release): ``grpo_loss`` lives in ``grpo_lightning.losses``, the advantages in
``grpo_lightning.advantages``, ``truncated_importance_weights`` in ``grpo_lightning.importance``."""

from __future__ import annotations

import warnings

from grpo_lightning.advantages import group_advantages, process_advantages
from grpo_lightning.importance import truncated_importance_weights
from grpo_lightning.losses import grpo_loss

warnings.warn(
    "grpo_lightning.loss is deprecated and goes in the next release: import grpo_loss from grpo_lightning.losses, "
    "group_advantages and process_advantages from grpo_lightning.advantages",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["group_advantages", "process_advantages", "grpo_loss", "truncated_importance_weights"]
