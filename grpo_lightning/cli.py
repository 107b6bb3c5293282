"""The command line: ``python -m grpo_lightning {fit,validate,test} --config configs/....yaml``.

Lightning's ``LightningCLI`` (jsonargparse): every hyperparameter of ``GRPOModule``, ``RolloutDataModule`` and the
``Trainer`` is a YAML key, overridable on the command line; several ``--config`` files compose left to right.
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import LightningCLI

from grpo_lightning.config import ConfigError
from grpo_lightning.module import GRPOModule
from grpo_lightning.rewards import RewardError
from grpo_lightning.rollout.datamodule import RolloutDataModule

# The settings a GRPO run needs from the Trainer: a fresh rollout every epoch, and no DistributedSampler
# re-splitting a rollout that each rank already built for itself.
TRAINER_DEFAULTS = {
    "reload_dataloaders_every_n_epochs": 1,
    "use_distributed_sampler": False,
    "num_sanity_val_steps": 0,
}


class GRPOCLI(LightningCLI):
    """``LightningCLI`` with GRPO's Trainer defaults."""

    def __init__(self, *args, **kwargs) -> None:
        if not args and "model_class" not in kwargs:
            args = (GRPOModule, RolloutDataModule)
        kwargs.setdefault("seed_everything_default", 0)
        kwargs.setdefault("trainer_defaults", TRAINER_DEFAULTS)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(*args, **kwargs)

    def before_fit(self) -> None:
        reload = self.trainer.reload_dataloaders_every_n_epochs
        if reload != 1:
            raise ConfigError(
                f"trainer.reload_dataloaders_every_n_epochs must be 1 for GRPO (got {reload}): each epoch is one "
                "rollout round"
            )


def user_error(err: BaseException) -> BaseException | None:
    """The ``ConfigError``/``RewardError`` behind ``err``, if any (jsonargparse wraps the ones raised while parsing)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, (ConfigError, RewardError)):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def main(args: list[str] | None = None) -> None:
    """Entry point: errors in the user's settings or data end the run with one line, not a traceback.

    Set ``GRPO_DEBUG=1`` to see the full traceback instead.
    """
    try:
        GRPOCLI(args=args)
    except Exception as err:
        cause = user_error(err)
        if cause is None or os.environ.get("GRPO_DEBUG"):
            raise
        print(f"error: {cause}", file=sys.stderr)
        sys.exit(2)
