"""``OldPolicySync``: at every round start the engine samples from the current policy, and π_old is where the
round needs it.

- Engines that share the module's weights (``lean``, ``transformers``) need nothing: the push is a no-op.
- An engine that holds its own copy (``vllm``) is given the policy's weights before each round (and before an
  evaluation) when they changed since its last push; the time it took is logged as ``time/weight_sync``.
- Every micro-batch trained after an optimizer step of its own round must carry π_old's log-probs (the policy
  is no longer the one that sampled): a rollout without them then stops the run instead of training with a ratio
  fixed at 1.

The CLI adds this callback to every run; without it, a round refuses to sample from a stale engine copy.
"""

from __future__ import annotations

import time
from typing import Any

from lightning import Callback, LightningModule, Trainer

from grpo_lightning.rollout.policy import EngineHandle


class OldPolicySync(Callback):
    """Pushes the policy's weights to a rollout engine that holds its own copy; checks π_old's presence."""

    def __init__(self) -> None:
        self.last_sync_s: float | None = None  # seconds of the latest push (None: nothing was pushed yet)
        self._round_start_step: int | None = None

    def sync(self, trainer: Trainer, pl_module: LightningModule) -> bool:
        """Give the DataModule's engine the policy's current weights if it holds a stale copy; True if it did."""
        handle = getattr(trainer.datamodule, "engine", None)
        if not isinstance(handle, EngineHandle) or getattr(pl_module, "policy", None) is None:
            return False
        engine = handle.get(pl_module)
        if engine.is_current(pl_module.global_step):
            return False
        start = time.perf_counter()
        # Under FSDP2 the engine gathers one parameter at a time (``DTensor.full_tensor``), on every rank: the
        # whole model is never gathered at once for the push.
        engine.load_weights(pl_module.policy, pl_module.global_step)
        self.last_sync_s = time.perf_counter() - start
        return True

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.sync(trainer, pl_module)  # after a resume, the checkpoint's weights

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Round start: the rollout runs right after this hook (when the round's first batch is fetched). At a
        rollout lag the background process samples the rounds and gets its weights from the schedule: this
        process's engine only evaluates, and is given the weights then."""
        pushed = False if getattr(trainer.datamodule, "background", None) is not None else self.sync(trainer, pl_module)
        self._round_start_step = trainer.global_step
        if pushed and self.last_sync_s is not None:
            pl_module.log("time/weight_sync", self.last_sync_s, on_step=False, on_epoch=True, batch_size=1)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """A run that fails stops its background rollout process (Lightning runs no teardown hook after an
        error; the process would otherwise wait, idle, until this one ends)."""
        background = getattr(trainer.datamodule, "background", None)
        if background is not None:
            background.close()

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        background = getattr(trainer.datamodule, "background", None)
        handle = getattr(trainer.datamodule, "engine", None)
        if background is not None and isinstance(handle, EngineHandle) and handle.engine.remote:
            # The servers are shared with the background process, which may be sampling a round ahead from the
            # weights it was given: it finishes that before the evaluation's push replaces them.
            background.schedule.drain()
        self.sync(trainer, pl_module)

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.sync(trainer, pl_module)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Refuse a micro-batch that would train off-policy without π_old (see the module docstring); at the round's
        first micro-batch, let the engine release what it needs only to generate (vLLM's sleep mode)."""
        handle = getattr(trainer.datamodule, "engine", None)
        if batch_idx == 0 and isinstance(handle, EngineHandle) and handle.engine.is_setup:
            handle.engine.offload()
        stepped = self._round_start_step is not None and trainer.global_step != self._round_start_step
        rollout_batch = isinstance(batch, dict) and "advantages" in batch  # not, e.g., an SFT batch
        if stepped and rollout_batch and batch.get("old_logprobs") is None:
            raise RuntimeError(
                f"micro-batch {batch_idx} of round {trainer.current_epoch + 1} comes after an optimizer step of "
                "its round but carries no π_old log-probs: the ratio would be fixed at 1. A round with more than "
                "one optimizer step must record them (rollout/round.py)"
            )
