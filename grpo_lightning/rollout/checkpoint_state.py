"""What a ``RolloutDataModule`` checkpoint holds, and how a resumed run takes it back.

Every rank's place in the prompt stream and its sampling generator (so a resumed run draws the prompts and tokens
an uninterrupted one would), the settings that made them (a change is allowed, with a warning), the curriculum's
pass rates, and at a rollout lag every rank's rounds sampled ahead (``rollout/schedule.py``: taken after waiting for
the round in flight, so nothing a resumed run needs is lost).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

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
