"""grpo_lightning: GRPO training of language models, native to PyTorch Lightning."""

from grpo_lightning.config import ConfigError, ObjectiveConfig, SamplingConfig
from grpo_lightning.module import GRPOModule
from grpo_lightning.rewards import RewardSpec
from grpo_lightning.rollout.datamodule import RolloutDataModule

__all__ = ["ConfigError", "GRPOModule", "ObjectiveConfig", "RewardSpec", "RolloutDataModule", "SamplingConfig"]
__version__ = "0.1.0"
