"""grpo_lightning: GRPO training of language models, native to PyTorch Lightning.

The names below are imported when first used: a process that needs only a part of the package (the background
rollout process of ``data.schedule.rollout_lag``) does not pay for Lightning's import.
"""

from __future__ import annotations

import importlib
from typing import Any

from grpo_lightning import moved_modules

moved_modules.install()  # the integrations' old module names still import, for a release (moved_modules.py)

_EXPORTS = {
    "AdvantageConfig": "grpo_lightning.config",
    "ConfigError": "grpo_lightning.config",
    "EvalConfig": "grpo_lightning.config",
    "ObjectiveConfig": "grpo_lightning.config",
    "SamplingConfig": "grpo_lightning.config",
    "ScheduleConfig": "grpo_lightning.config",
    "UpdateConfig": "grpo_lightning.config",
    "GRPOModule": "grpo_lightning.module",
    "LossInputs": "grpo_lightning.losses",
    "register_policy_loss": "grpo_lightning.losses",
    "RewardSpec": "grpo_lightning.rewards",
    "RolloutDataModule": "grpo_lightning.rollout.datamodule",
    "SFTDataModule": "grpo_lightning.integrations.sft",
    "SFTModule": "grpo_lightning.integrations.sft",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'grpo_lightning' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
