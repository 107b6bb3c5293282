"""``RoundLog``: one plain line per round, for output that goes to a file (SLURM, nohup, a CI job).

Why: a progress bar written to a file is a stream of carriage returns that shows only its last state, and a
process whose standard output is not a terminal buffers ``print`` for minutes. This callback writes one flushed line
per round to standard error instead::

    round 3/40 | reward 0.412 | accuracy 61.2% | 2710 gen tok/s | 0.9 s/round | ETA 0:00:33

``accuracy`` appears in the rounds that ran held-out evaluation. The command line adds it to every run (unless the
config has one) and turns the progress bar off when standard error is not a terminal.
"""

from __future__ import annotations

import math
import sys
import time
from datetime import timedelta
from typing import Any, TextIO

from lightning import Callback, LightningModule, Trainer


def is_terminal(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (standard error by default) is a terminal."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class RoundLog(Callback):
    """Writes ``round r/N | reward | accuracy | gen tok/s | s/round | ETA`` at the end of every round (rank 0)."""

    def __init__(self, when: str = "not_terminal", stream: TextIO | None = None) -> None:
        """
        Args:
            when: ``not_terminal`` (only when standard error is not a terminal: a log file), ``always`` or
                ``never``.
            stream: where the lines go (default: standard error, looked up at each line).
        """
        if when not in ("not_terminal", "always", "never"):
            raise ValueError(f"RoundLog.when must be not_terminal, always or never (got {when!r})")
        self.when, self.stream = when, stream
        self._round_start: float | None = None
        self._durations: list[float] = []
        self._evaluated = False

    def _active(self) -> bool:
        if self.when == "not_terminal":
            return not is_terminal(self.stream)
        return self.when == "always"

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._round_start, self._evaluated = time.perf_counter(), False

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._evaluated = not trainer.sanity_checking

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._round_start is None:
            return
        seconds = time.perf_counter() - self._round_start
        self._durations.append(seconds)
        if not trainer.is_global_zero or not self._active():
            return
        line = round_line(trainer, seconds, self._durations, self._evaluated)
        stream = self.stream if self.stream is not None else sys.stderr
        print(line, file=stream, flush=True)


def _value(metrics: dict[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    value = float(value) if value is not None else None
    return value if value is not None and not math.isnan(value) else None


def round_line(trainer: Trainer, seconds: float, durations: list[float], evaluated: bool) -> str:
    """The line of the round that just ended (``durations``: every round's seconds so far, this one included)."""
    metrics = trainer.callback_metrics
    done = trainer.current_epoch + 1
    total = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs > 0 else None
    parts = [f"round {done}/{total}" if total else f"round {done}"]
    reward = _value(metrics, "rollout/reward_mean")
    if reward is not None:
        parts.append(f"reward {reward:.3f}")
    accuracy = _value(metrics, "val/accuracy") if evaluated else None
    if accuracy is not None:
        parts.append(f"accuracy {100 * accuracy:.1f}%")
    rate = _value(metrics, "time/generated_tokens_per_s")
    if rate is not None:
        parts.append(f"{rate:.0f} gen tok/s")
    parts.append(f"{seconds:.1f} s/round")
    if total:
        recent = durations[-10:]  # the recent pace: the first rounds include warm-up
        remaining = max(total - done, 0) * sum(recent) / len(recent)
        parts.append(f"ETA {timedelta(seconds=round(remaining))}")
    return " | ".join(parts)
