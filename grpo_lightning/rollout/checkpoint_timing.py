"""When a checkpoint can be taken at a rollout lag: at round ends only (``check_checkpoint_timing``).

A ``RolloutDataModule`` checkpoint (its ``state_dict``) holds every rank's place in the prompt stream and its
sampling generator, and at a rollout lag every rank's rounds sampled ahead (``rollout/schedule.py``: taken after
waiting for the round in flight). At a lag that is all a checkpoint can resume from, so a checkpoint callback that
saves inside a round is refused before training.
"""

from __future__ import annotations

from lightning import Trainer

from grpo_lightning.config import ConfigError


def check_checkpoint_timing(trainer: Trainer, *, lag: int, round_batches: int, held_out: bool) -> None:
    """At ``data.schedule.rollout_lag`` = ``lag`` > 0, refuse before training a checkpoint callback that saves inside a
    round (one of ``round_batches`` micro-batches; ``held_out``: there are held-out rows to validate on).

    Why: a checkpoint at a lag holds the rounds sampled ahead, not the rollout in training (sampled by the weights
    of L rounds before, which no checkpoint keeps). A run resumed inside round k would have nothing to train the
    rest of it on: the schedule would wait for a round it never launched, after the run had started. Saving at round
    ends (``RoundCheckpoint``, the CLI's default; ``every_n_epochs`` with ``save_on_train_epoch_end``) resumes
    exactly. At lag 0 such a checkpoint stays allowed, as in Lightning: its resume trains the rest of the round on a
    fresh rollout (not exactly; Lightning warns).

    Lightning's ``ModelCheckpoint`` says when it saves only in private attributes (and the Trainer whether it
    validates by time): read here as Lightning's own code reads them (docs/how_it_works.md, Lightning internals).
    """
    if lag < 1:
        return
    batches = round_batches  # a round's micro-batches
    # A time-based val_check_interval is kept only as seconds, in a private attribute (Lightning sets no other).
    seconds = getattr(trainer, "_val_check_time_interval", None)
    interval = getattr(trainer, "val_check_interval", 1.0)
    mid_round_validation = (  # a round of one batch validates after it at the earliest, as at its end
        held_out
        and trainer.limit_val_batches != 0
        and batches > 1
        and (
            seconds is not None
            or (isinstance(interval, float) and interval < 1.0)
            or (isinstance(interval, int) and interval % batches != 0)
        )
    )
    for checkpoint in trainer.checkpoint_callbacks:
        name = type(checkpoint).__name__
        steps = getattr(checkpoint, "_every_n_train_steps", 0)
        every = getattr(checkpoint, "_train_time_interval", None)
        fix = (
            "save at round ends: grpo_lightning.callbacks.RoundCheckpoint(every_n_rounds=N), or "
            f"{name}(every_n_epochs=N, save_on_train_epoch_end=True) (one epoch is one round)"
        )
        if steps:
            what = f"{name}(every_n_train_steps={steps})"
        elif every is not None:
            what = f"{name}(train_time_interval={every})"
        elif (
            mid_round_validation
            and getattr(checkpoint, "_save_on_train_epoch_end", None) is not True
            and (getattr(checkpoint, "every_n_epochs", 0) or 0) >= 1
        ):
            when = f"every {seconds:g} s" if seconds is not None else str(interval)
            what = f"{name} (after each validation, trainer.val_check_interval={when})"
            fix = "give it save_on_train_epoch_end: true (it then saves at round ends)"
        else:
            continue
        raise ConfigError(
            f"trainer.callbacks: {what} saves inside a round, which a run at data.schedule.rollout_lag={lag} cannot "
            f"resume from (its checkpoint holds the rounds sampled ahead, not the one in training); {fix}"
        )
