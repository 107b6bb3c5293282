"""Callbacks and the W&B logger: what a run shows while it trains.

Add them under ``trainer.callbacks`` / ``trainer.logger`` in the YAML config, e.g.
``class_path: grpo_lightning.callbacks.RoundTimer``.
"""

from grpo_lightning.callbacks.checkpointing import AtomicCheckpointIO, RoundCheckpoint
from grpo_lightning.callbacks.completions import CompletionsTable
from grpo_lightning.callbacks.console import ConsoleSamples
from grpo_lightning.callbacks.timing import RoundTimer
from grpo_lightning.callbacks.wandb_logger import GRPOWandbLogger, LoggerSaveConfigCallback, wandb_mode

__all__ = [
    "AtomicCheckpointIO",
    "CompletionsTable",
    "ConsoleSamples",
    "GRPOWandbLogger",
    "LoggerSaveConfigCallback",
    "RoundCheckpoint",
    "RoundTimer",
    "wandb_mode",
]
