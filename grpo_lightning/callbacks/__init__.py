"""Callbacks and the W&B logger: what runs beside the training loop.

Add them under ``trainer.callbacks`` / ``trainer.logger`` in the YAML config, e.g.
``class_path: grpo_lightning.callbacks.RoundTimer``.
"""

from grpo_lightning.callbacks.checkpointing import RoundCheckpoint
from grpo_lightning.callbacks.completions import CompletionsTable
from grpo_lightning.callbacks.console import ConsoleSamples
from grpo_lightning.callbacks.export import SaveHFModel
from grpo_lightning.callbacks.kl import KLController, ReferenceSync
from grpo_lightning.callbacks.policy_sync import OldPolicySync
from grpo_lightning.callbacks.progress import RoundProgressBar
from grpo_lightning.callbacks.round_log import RoundLog
from grpo_lightning.callbacks.timing import RoundTimer
from grpo_lightning.callbacks.wandb_logger import GRPOWandbLogger, LoggerSaveConfigCallback, wandb_mode

__all__ = [
    "CompletionsTable",
    "ConsoleSamples",
    "GRPOWandbLogger",
    "KLController",
    "LoggerSaveConfigCallback",
    "OldPolicySync",
    "ReferenceSync",
    "RoundCheckpoint",
    "RoundLog",
    "RoundProgressBar",
    "RoundTimer",
    "SaveHFModel",
    "wandb_mode",
]
