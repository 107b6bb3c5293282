"""grpo_lightning: GRPO training of language models, native to PyTorch Lightning."""

from grpo_lightning.config import ConfigError, ObjectiveConfig, SamplingConfig
from grpo_lightning.module import GRPOModule
from grpo_lightning.rewards import RewardSpec
from grpo_lightning.rollout.datamodule import RolloutDataModule

__all__ = [
    "ConfigError",
    "GRPOModule",
    "SFTModule",
    "ObjectiveConfig",
    "RewardSpec",
    "RolloutDataModule",
    "SamplingConfig",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # Imported on first use: importing it here would make ``python -m grpo_lightning.sft`` load it twice.
    if name == "SFTModule":
        from grpo_lightning.sft import SFTModule

        return SFTModule
    raise AttributeError(f"module 'grpo_lightning' has no attribute {name!r}")
