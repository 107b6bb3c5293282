"""``RoundTimer``: the time of each round's update and its training throughput, next to the rollout's timings.

The rollout (``time/generate``, ``time/score``, ``time/logprobs``) runs when the round's first batch is fetched;
the update is everything from the start of that first batch to the end of the round's last training batch, so
neither the rollout nor a validation run at the round's end is counted.
"""

from __future__ import annotations

import time

from lightning import Callback, LightningModule, Trainer

from grpo_lightning.rollout.datamodule import latest_rollout


class RoundTimer(Callback):
    """Logs ``time/update``, ``time/round`` and ``time/trained_tokens_per_s`` every round.

    ``time/round`` is the rollout's phases (every ``time/`` value of the rollout but the rates) plus the update.
    ``time/trained_tokens_per_s`` counts the completion tokens that entered the loss (every pass, μ of them per
    round) per second of update. While a round runs, the progress bar shows that throughput so far as
    ``train_tok/s``.
    """

    def __init__(self, progress_bar: bool = True) -> None:
        """
        Args:
            progress_bar: show the running ``train_tok/s`` in the progress bar's postfix.
        """
        self.progress_bar = progress_bar
        self._start: float | None = None
        self._last_batch_end: float | None = None
        self._tokens = 0

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = self._last_batch_end = None
        self._tokens = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: dict, batch_idx: int) -> None:
        if self._start is None:  # the round's first batch: its rollout has just been generated
            self._start = time.perf_counter()
        mask = batch.get("completion_mask") if isinstance(batch, dict) else None
        if mask is not None:
            self._tokens += int(mask.sum())

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: object, batch: dict, batch_idx: int
    ) -> None:
        self._last_batch_end = time.perf_counter()
        if self.progress_bar and self._start is not None:
            seconds = self._last_batch_end - self._start
            if seconds > 0:
                rate = float(round(self._tokens / seconds))  # whole tokens/s keep the postfix short
                pl_module.log("train_tok/s", rate, prog_bar=True, logger=False, batch_size=1)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._start is None or self._last_batch_end is None:
            return
        update = self._last_batch_end - self._start
        metrics = {"time/update": update}
        if update > 0:
            metrics["time/trained_tokens_per_s"] = self._tokens / update
        rollout = latest_rollout(trainer)
        if rollout is not None:
            # Every rollout timing is a phase in seconds (generate, score, logprobs, ...) except the rates.
            phases = [v for k, v in rollout.metrics.items() if k.startswith("time/") and not k.endswith("_per_s")]
            metrics["time/round"] = update + sum(v for v in phases if v == v)
        pl_module.log_dict(metrics, on_step=False, on_epoch=True, batch_size=1)
        self._start = None
