"""``CompletionsTable``: the round's prompts, completions, rewards and advantages as a W&B table, every N rounds."""

from __future__ import annotations

from typing import Any

from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_warn

from grpo_lightning.config import ConfigError
from grpo_lightning.rewards.inputs import prompt_text
from grpo_lightning.rollout.batch import RolloutBatch
from grpo_lightning.rollout.datamodule import latest_rollout


def completion_advantages(rollout: RolloutBatch) -> list[float]:
    """One advantage per completion (per-token advantages, from process rewards, are averaged over its tokens)."""
    advantages = rollout.advantages.float()
    if advantages.dim() == 1:
        return advantages.tolist()
    mask = rollout.completion_mask[:, : advantages.size(1)].float()
    return ((advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)).tolist()


def completion_rows(rollout: RolloutBatch, indices: list[int] | None = None) -> tuple[list[str], list[list[Any]]]:
    """Columns ``prompt, completion, reward, <each reward function>, advantage`` and the rows of ``indices``, then
    the columns reward functions added with TRL's ``log_extra``.

    Multi-turn rollouts add ``turns`` and ``transcript`` (every turn and observation) after ``completion``, which
    is then the final turn that the rewards scored.
    """
    names, extra = list(rollout.reward_columns), list(rollout.extra_columns)
    turns = rollout.turn_stats.get("turns") if rollout.transcripts else None
    columns = ["prompt", "completion", *(["turns", "transcript"] if turns else []), "reward", *names, "advantage"]
    columns += extra
    rewards, advantages = rollout.rewards.float().tolist(), completion_advantages(rollout)
    rows = []
    for i in range(len(rollout.completions)) if indices is None else indices:
        per_function = [rollout.reward_columns[name][i] for name in names]
        multiturn = [int(turns[i]), rollout.transcripts[i]] if turns else []
        prompt = prompt_text(rollout.prompts[i])  # a conversation as one role: content line per message
        logged = [rollout.extra_columns[name][i] for name in extra]
        rows.append([prompt, rollout.completions[i], *multiturn, rewards[i], *per_function, advantages[i], *logged])
    return columns, rows


def image_cells(rollout: RolloutBatch, indices: list[int]) -> tuple[list[str], list[list[Any]]]:
    """A vision-language model's prompt images for the rows ``indices``: columns ``image_1`` … ``image_K`` (K: the
    most images one of these prompts has), one ``wandb.Image`` per cell, None where a prompt has fewer. A W&B
    table cell holds one image, so a prompt's images sit side by side in order. No columns for a text model."""
    if not rollout.images:
        return [], [[] for _ in indices]
    import wandb

    most = max((len(rollout.images[i]) for i in indices), default=0)
    rows = []
    for i in indices:
        images = [wandb.Image(image) for image in rollout.images[i]]
        rows.append(images + [None] * (most - len(images)))
    return [f"image_{k + 1}" for k in range(most)], rows


def is_logging_round(trainer: Trainer, every_n_rounds: int) -> bool:
    """Rounds 0, N, 2N, ...: the first round shows the starting model's completions."""
    return trainer.current_epoch % every_n_rounds == 0


class CompletionsTable(Callback):
    """Logs the round's completions to W&B as ``<key>/round_<r>``, one table per logged round (none overwritten).

    Columns: ``round``, ``step``, ``prompt`` (a vision-language model's prompt images beside it: ``image_1``,
    ...), ``completion`` (with ``turns`` and ``transcript`` for multi-turn
    rollouts), ``reward`` (the weighted total), one column per
    reward function (empty where it did not apply) and ``advantage``. Needs a ``WandbLogger``; under data
    parallelism the table holds rank 0's share of the round. For a run without W&B, see ``ConsoleSamples``.
    """

    def __init__(self, every_n_rounds: int = 10, max_rows: int | None = None, key: str = "completions") -> None:
        """
        Args:
            every_n_rounds: log rounds 0, N, 2N, ...
            max_rows: keep the round's first ``max_rows`` completions (whole groups first); ``None`` = all.
            key: prefix of the table keys.
        """
        if every_n_rounds < 1:
            raise ConfigError(f"CompletionsTable.every_n_rounds must be >= 1 (got {every_n_rounds})")
        if max_rows is not None and max_rows < 1:
            raise ConfigError(f"CompletionsTable.max_rows must be >= 1, or null for all (got {max_rows})")
        self.every_n_rounds, self.max_rows, self.key = every_n_rounds, max_rows, key
        self._warned = False

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero or not is_logging_round(trainer, self.every_n_rounds):
            return
        rollout = latest_rollout(trainer)
        loggers = [logger for logger in trainer.loggers if isinstance(logger, WandbLogger)]
        if rollout is None or not rollout.completions:
            return
        if not loggers:
            if not self._warned:
                rank_zero_warn("CompletionsTable logs to W&B only and the trainer has no WandbLogger: nothing logged")
                self._warned = True
            return
        count = len(rollout.completions) if self.max_rows is None else min(self.max_rows, len(rollout.completions))
        columns, rows = completion_rows(rollout, list(range(count)))
        image_columns, images = image_cells(rollout, list(range(count)))  # after the prompt they belong to
        columns = [columns[0], *image_columns, *columns[1:]]
        rows = [[row[0], *cells, *row[1:]] for row, cells in zip(rows, images)]
        round_, step = trainer.current_epoch, trainer.global_step
        columns, data = ["round", "step", *columns], [[round_, step, *row] for row in rows]
        for logger in loggers:
            logger.log_table(f"{self.key}/round_{round_:04d}", columns=columns, data=data, step=step)
