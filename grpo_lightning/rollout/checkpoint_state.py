"""What a ``RolloutDataModule`` checkpoint holds, and how a resumed run takes it back.

Every rank's place in the prompt stream and its sampling generator (so a resumed run draws the prompts and tokens
an uninterrupted one would), the settings that made them (a change is allowed, with a warning), the curriculum's
pass rates, and at a rollout lag every rank's rounds sampled ahead (``rollout/schedule.py``: taken after waiting for
the round in flight, so nothing a resumed run needs is lost). At a lag that is all a checkpoint can resume from,
so a checkpoint callback that saves inside a round is refused before training (``check_checkpoint_timing``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from grpo_lightning.config import ConfigError
from grpo_lightning.strategies import gather_per_rank

log = logging.getLogger(__name__)


def datamodule_state(datamodule: Any) -> dict[str, Any]:
    """``RolloutDataModule.state_dict``: a collective under data parallelism (every rank's part is gathered)."""
    dm = datamodule
    generator = dm.generator.get_state() if dm.generator is not None else dm._generator_state
    mine = {"sampling_generator": generator}
    if dm.background is not None:  # its finished rounds, after waiting for the one in flight
        mine["background"] = dm.background.state_dict(dm.stream)
    mine["position"] = dm.position  # after the background's rounds moved it
    ranks = gather_per_rank(dm.trainer, mine)
    state = {
        "position": ranks[0]["position"],  # rank 0's, as checkpoints without ``positions`` have it
        "positions": [r["position"] for r in ranks],
        "sampling_generators": [r["sampling_generator"] for r in ranks],
        "seed": dm.seed,
        "dataset": dm.source,
        "prompts_per_round": dm.prompts_per_round,
        "sampling": dataclasses.asdict(dm.sampling),  # what sampled: tools/export_hf.py's generation config
    }
    if dm.curriculum is not None:  # the per-prompt pass rates: a key of its own
        state["curriculum"] = dm.curriculum.state_dict()
    if dm.background is not None:
        state["background"] = [r["background"] for r in ranks]
    return state


def restore_datamodule(datamodule: Any, state: dict[str, Any]) -> None:
    """``RolloutDataModule.load_state_dict``: this rank's part of ``datamodule_state``'s output."""
    dm = datamodule
    world = dm.trainer.world_size if dm.trainer is not None else 1
    rank = dm.trainer.global_rank if dm.trainer is not None else 0
    dm.stream.restore(state.get("positions") or [state.get("position")], rank, world)
    generators = state.get("sampling_generators") or []
    dm._generator_state = generators[rank] if len(generators) == world else None
    dm.generator = None
    queues = state.get("background") or []
    if dm.background is not None:
        if queues and len(queues) != world:
            log.warning(
                "the checkpoint's rounds sampled ahead were made by %d processes, this run has %d: they are sampled "
                "again, from the checkpoint's weights",
                len(queues),
                world,
            )
        dm.background.load_state_dict(queues[rank] if len(queues) == world else None)
    elif queues:
        log.warning("the checkpoint holds rounds sampled ahead (data.rollout_lag > 0): a run at lag 0 drops them")
    changed = [
        f"data.{key}={state[key]!r}"
        for key, value in (("seed", dm.seed), ("dataset", dm.source), ("prompts_per_round", dm.prompts_per_round))
        if key in state and state[key] != value
    ]
    if changed:
        # Allowed (a new dataset or seed can be intended), but the run then differs from an uninterrupted one.
        log.warning(
            "resuming a prompt stream made with %s; it continues at position %d", ", ".join(changed), dm.position
        )
    if dm.curriculum is not None and "curriculum" in state:
        dm.curriculum.load_state_dict(state["curriculum"])


def check_checkpoint_timing(datamodule: Any) -> None:
    """At ``data.rollout_lag`` > 0, refuse before training a checkpoint callback that saves inside a round.

    Why: a checkpoint at a lag holds the rounds sampled ahead, not the rollout in training (sampled by the weights
    of L rounds before, which no checkpoint keeps). A run resumed inside round k would have nothing to train the
    rest of it on: the schedule would wait for a round it never launched, after the run had started. Saving at round
    ends (``RoundCheckpoint``, the CLI's default; ``every_n_epochs`` with ``save_on_train_epoch_end``) resumes
    exactly. At lag 0 such a checkpoint stays allowed, as in Lightning: its resume trains the rest of the round on a
    fresh rollout (not exactly; Lightning warns).

    Lightning's ``ModelCheckpoint`` says when it saves only in private attributes (and the Trainer whether it
    validates by time): read here as Lightning's own code reads them (README, Lightning internals).
    """
    dm, trainer = datamodule, datamodule.trainer
    if dm.rollout_lag < 1:
        return
    mini = dm.mini_batch_size or dm.rollout_size
    batches = dm.num_iterations * dm.rollout_size // (dm.micro_batch_size or mini)  # a round's micro-batches
    # A time-based val_check_interval is kept only as seconds, in a private attribute (Lightning sets no other).
    seconds = getattr(trainer, "_val_check_time_interval", None)
    interval = getattr(trainer, "val_check_interval", 1.0)
    mid_round_validation = (  # a round of one batch validates after it at the earliest, as at its end
        dm.val_data is not None
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
            f"trainer.callbacks: {what} saves inside a round, which a run at data.rollout_lag={dm.rollout_lag} cannot "
            f"resume from (its checkpoint holds the rounds sampled ahead, not the one in training); {fix}"
        )
