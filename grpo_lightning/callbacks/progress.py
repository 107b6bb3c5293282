"""``RoundProgressBar``: the terminal's progress bar in the words of the rest of the run.

Lightning's bar (``RichProgressBar``, its default when ``rich`` is installed, as it is here) counts epochs from 0,
``Epoch 39/39`` for the 40th of 40, and prints every value with three decimals, ``gen_tok/s: 23754.000``. A GRPO
epoch is one rollout round, and the log lines (``RoundLog``), checkpoints (``round040.ckpt``) and the end-of-run
summary count rounds from 1: the bar says ``Round 40/40`` and prints rates as whole numbers, ``gen_tok/s: 23754``.
What the loggers receive is unchanged. The command line gives this bar to every GRPO run that shows one.
"""

from __future__ import annotations

from typing import Any

from lightning import LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar

from grpo_lightning.callbacks.round_log import is_terminal


def round_description(current_epoch: int, max_epochs: int | None) -> str:
    """``Round k/N`` for the round that epoch ``current_epoch`` (from 0) runs; ``Round k`` with no round limit."""
    done = current_epoch + 1
    return f"Round {done}/{max_epochs}" if max_epochs is not None and max_epochs > 0 else f"Round {done}"


def is_rate(name: str) -> bool:
    """Whether a progress bar entry is a rate (``gen_tok/s``, ``train_tok/s``): shown as a whole number."""
    return name.endswith("/s")


class RoundProgressBar(RichProgressBar):
    """``RichProgressBar`` that says ``Round k/N`` (counted from 1) and prints whole-number rates as integers.

    Takes ``RichProgressBar``'s arguments (``refresh_rate``, ``leave``, ``theme``, ``console_kwargs``).
    """

    def _get_train_description(self, current_epoch: int) -> str:
        # Lightning's one place for the training bar's text, at each round's start and when a resumed round's bar
        # is made (docs/how_it_works.md, "Lightning internals we rely on"): setting it here, not after Lightning has
        # set its own, leaves no moment at which the refresh thread could draw "Epoch".
        text = round_description(current_epoch, self.trainer.max_epochs)
        return f"{text:{len(self.validation_description)}}"  # as Lightning pads: no flicker beside "Validation"

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        """Lightning's entries, with each whole-number rate as text (``23754``): the bar would print it as
        ``23754.000``. The values logged to W&B and CSV are not these and stay floats."""
        items = super().get_metrics(trainer, pl_module)
        for name, value in items.items():
            if is_rate(name) and isinstance(value, (int, float)) and float(value).is_integer():
                items[name] = str(int(value))
        return items


def default_progress_bar(trainer: Any, callbacks: list[Any]) -> RoundProgressBar | None:
    """The bar of a GRPO run whose config names none: a ``RoundProgressBar`` wherever Lightning would draw its own
    (``trainer.enable_progress_bar`` true, or unset on a terminal); None when the config has a progress bar
    callback (it wins) or the run shows none (``enable_progress_bar: false``, or unset and writing to a file)."""
    if any(isinstance(c, ProgressBar) for c in callbacks):
        return None
    enabled = trainer.get("enable_progress_bar")
    return RoundProgressBar() if (is_terminal() if enabled is None else enabled) else None
