"""The GRPO objective's public entry points in one place: advantages and ``grpo_loss``.

The functions live in ``grpo_lightning.advantages`` (group and process advantages) and ``grpo_lightning.losses``
(the registry of policy losses, KL estimators, aggregations and the assembled objective); this module keeps the
import path that configs, tools and users' code already use (``from grpo_lightning.loss import grpo_loss``).
"""

from __future__ import annotations

from grpo_lightning.advantages import group_advantages, process_advantages
from grpo_lightning.importance import truncated_importance_weights
from grpo_lightning.losses import grpo_loss

__all__ = ["group_advantages", "process_advantages", "grpo_loss", "truncated_importance_weights"]
