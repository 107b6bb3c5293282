"""``ConsoleSamples``: a few of the round's completions and their rewards as a ``rich`` table on the console."""

from __future__ import annotations

import random

from lightning import Callback, LightningModule, Trainer
from rich.console import Console
from rich.table import Table

from grpo_lightning.callbacks.completions import completion_rows, is_logging_round
from grpo_lightning.config import ConfigError
from grpo_lightning.rollout.datamodule import latest_rollout

_TEXT = ("prompt", "completion", "transcript")


def _clip(value: object, max_chars: int) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    text = "" if value is None else str(value)
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


class ConsoleSamples(Callback):
    """Every N rounds, prints ``num_samples`` completions drawn at random from the round, with their rewards.

    For runs without W&B (or to keep an eye on the terminal): columns as ``CompletionsTable``'s. The draw is
    seeded by ``seed`` and the round, so reruns show the same rows; only rank 0 prints.
    """

    def __init__(self, every_n_rounds: int = 10, num_samples: int = 4, max_chars: int = 200, seed: int = 0) -> None:
        """
        Args:
            every_n_rounds: print at the first round and every N-th after it (rounds 1, N + 1, 2N + 1, ...)
            num_samples: completions shown per table.
            max_chars: longer prompts and completions are cut to this many characters.
            seed: seed of the draw of the rows.
        """
        for name, value in (("every_n_rounds", every_n_rounds), ("num_samples", num_samples), ("max_chars", max_chars)):
            if value < 1:
                raise ConfigError(f"ConsoleSamples.{name} must be >= 1 (got {value})")
        self.every_n_rounds, self.num_samples, self.max_chars, self.seed = every_n_rounds, num_samples, max_chars, seed
        self.console = Console()  # an attribute, not an argument: tests and notebooks may swap it

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero or not is_logging_round(trainer, self.every_n_rounds):
            return
        rollout = latest_rollout(trainer)
        if rollout is None or not rollout.completions:
            return
        count = len(rollout.completions)
        draw = random.Random(self.seed * 1_000_003 + trainer.current_epoch)
        indices = sorted(draw.sample(range(count), min(self.num_samples, count)))
        columns, rows = completion_rows(rollout, indices)
        reward = rollout.metrics.get("rollout/reward_mean", float("nan"))
        title = f"round {trainer.current_epoch + 1} · step {trainer.global_step} · mean reward {reward:.3g}"
        table = Table(title=title)  # rounds counted from 1, as the progress bar and the log lines count them
        for name in columns:
            table.add_column(name, overflow="fold", justify="left" if name in _TEXT else "right")
        for row in rows:
            table.add_row(*(_clip(value, self.max_chars) for value in row))
        self.console.print(table)
