"""grpo_lightning: GRPO training of language models, native to PyTorch Lightning."""

from grpo_lightning.config import AdvantageConfig, ConfigError, EvalConfig, ObjectiveConfig, SamplingConfig
from grpo_lightning.module import GRPOModule
from grpo_lightning.rewards import RewardSpec
from grpo_lightning.rollout.datamodule import RolloutDataModule
from grpo_lightning.sft import SFTDataModule, SFTModule

__all__ = [
    "AdvantageConfig",
    "ConfigError",
    "EvalConfig",
    "GRPOModule",
    "ObjectiveConfig",
    "RewardSpec",
    "RolloutDataModule",
    "SFTDataModule",
    "SFTModule",
    "SamplingConfig",
]
__version__ = "0.1.0"
