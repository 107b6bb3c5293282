"""``OldPolicySync``: deprecated, kept for one release so that configs and scripts listing it keep running.

What it did is now part of the round itself (``rollout/collector.py: RolloutCollector.collect``): the weight push
before each round and each evaluation, the drain of the background process before an evaluation's push, the
release of generation memory, the check of π_old, and stopping the background process when a run fails. A run
is correct without any callback; this one does nothing but say so, once.
"""

from __future__ import annotations

from lightning import Callback
from lightning.pytorch.utilities import rank_zero_deprecation


class OldPolicySync(Callback):
    """Does nothing (see the module docstring); remove it from ``trainer.callbacks``."""

    def __init__(self) -> None:
        rank_zero_deprecation(
            "grpo_lightning.callbacks.OldPolicySync is no longer needed (the rollout collector pushes the weights "
            "itself) and goes in the next release: remove it from trainer.callbacks"
        )
