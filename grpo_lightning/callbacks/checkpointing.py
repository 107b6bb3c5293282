"""``RoundCheckpoint``: checkpoints that resume a run exactly, saved at round boundaries, also on SIGTERM.

- Saves every ``every_n_rounds`` rounds, after every other end-of-round hook (so the adaptive β of
  ``KLController`` is already updated), and keeps ``last.ckpt`` for ``--ckpt_path last``.
- Adds every rank's global RNG states (torch, CUDA, numpy, python) to each checkpoint and restores them: with
  the DataModule's prompt and sampling streams, a resumed run draws what an uninterrupted one would have.
- A SIGTERM (pre-emption) during a rollout stops the run at once with a checkpoint of the last completed round;
  one during the update lets the round finish, then saves it and stops. A run that fails during a rollout (a
  reward function that raises, say) also leaves a checkpoint of the last completed round.

Files are written atomically when the Trainer has ``grpo_lightning.checkpoint_io.AtomicCheckpointIO`` as a
plugin (the CLI adds it); without it a warning says so.
"""

from __future__ import annotations

import copy
import logging
import os
import random
import signal
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from grpo_lightning.checkpoint_io import remove_partial_checkpoints
from grpo_lightning.collectives import gather_per_rank
from grpo_lightning.config import ConfigError

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ RNG states
def collect_rng_states() -> dict[str, Any]:
    """The global RNG states: torch, CUDA (if initialised), numpy and python, in types ``weights_only`` loads."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        # A numpy array would need numpy's globals allowed for weights_only loading: keep the key as a tensor.
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    """Set the global RNGs from :func:`collect_rng_states`' output (missing entries are left alone)."""
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    if "numpy" in states:
        kind, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "python" in states:
        version, internal, gauss = states["python"]
        random.setstate((version, tuple(internal), gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


# --------------------------------------------------------------------------------------------- the callback
class RoundCheckpoint(ModelCheckpoint):
    """Round-boundary checkpoints for exact resume (``--ckpt_path last``), written atomically.

    The filename template may use ``{round}``: the number of rounds completed (``{epoch}`` is that minus one).
    """

    def __init__(
        self,
        dirpath: str | None = None,
        filename: str = "round{round:04d}",
        every_n_rounds: int = 1,
        save_top_k: int = 1,
        save_last: bool = True,
        save_weights_only: bool = False,
        stop_on_sigterm: bool = True,
        verbose: bool = False,
    ) -> None:
        """
        Args:
            dirpath: folder of the checkpoints (default: ``<default_root_dir or logger dir>/checkpoints``).
            filename: template of the periodic checkpoints' names (``{round}``, ``{epoch}``, ``{step}``).
            every_n_rounds: save every N rounds.
            save_top_k: periodic checkpoints to keep (the newest ones); -1 keeps all.
            save_last: also keep ``last.ckpt``, the newest checkpoint, for ``--ckpt_path last``.
            save_weights_only: weights only (such a checkpoint cannot resume training).
            stop_on_sigterm: on SIGTERM, save the last completed round and stop (otherwise Lightning's default).
            verbose: log every save.
        """
        if every_n_rounds < 1:
            raise ConfigError(f"RoundCheckpoint.every_n_rounds must be >= 1 (got {every_n_rounds})")
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            save_last=save_last,
            save_top_k=save_top_k,
            save_weights_only=save_weights_only,
            every_n_epochs=every_n_rounds,
            # Round boundaries only: after validation and after every other callback's end-of-round hook.
            save_on_train_epoch_end=True,
            auto_insert_metric_name=False,
            verbose=verbose,
        )
        self.stop_on_sigterm = stop_on_sigterm
        self._sigterm = False
        self._previous_handler: Any = None
        self._handler_installed = False
        # Between rounds (from the end of one round's update to the start of the next one's) the weights,
        # optimizer and callbacks hold the last completed round; only the prompt stream and the RNGs move, as the
        # rollout draws from them. Their values at the boundary make a checkpoint of that round possible then.
        self._at_boundary = False
        self._boundary: dict[str, Any] | None = None
        self._saved_at_step: int | None = None  # global step of the newest checkpoint any callback saved
        self._warned_io = False

    # ------------------------------------------------------------------------------------------ naming
    def format_checkpoint_name(
        self, metrics: dict[str, Any], filename: str | None = None, ver: int | None = None, prefix: str | None = None
    ) -> str:
        """Lightning's naming, plus ``{round}`` = epoch + 1, the rounds completed when the file is written."""
        if "epoch" in metrics and "round" not in metrics:
            metrics = {**metrics, "round": metrics["epoch"] + 1}
        return super().format_checkpoint_name(metrics, filename=filename, ver=ver, prefix=prefix)

    # ----------------------------------------------------------------------------------------- hooks
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Resolve the folder, clear what a killed write left behind."""
        super().setup(trainer, pl_module, stage)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO and not self._warned_io:
            self._warned_io = True
            log.warning(
                "checkpoints are written with Lightning's TorchCheckpointIO, not atomically: give the Trainer "
                "plugins=[grpo_lightning.checkpoint_io.AtomicCheckpointIO()] (the CLI does)"
            )
        if stage == "fit" and trainer.is_global_zero and self.dirpath and "://" not in str(self.dirpath):
            for path in remove_partial_checkpoints(self.dirpath):
                log.info("removed %s, left by a checkpoint write that did not finish", path)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Take the boundary state; install the SIGTERM handler (Lightning composes it with its own for now)."""
        self._sigterm = False
        self._install_handler()
        self._take_boundary(trainer, pl_module)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Replace Lightning's SIGTERM handler, which would stop the run mid-round, by ours alone."""
        self._install_handler(exclusive=True)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """The rollout is done (it runs when the round's first batch is fetched) and the update begins: from now
        on the round is incomplete."""
        self._at_boundary = False

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Every rank's global RNG states go into the checkpoint (called on every rank, as the save is)."""
        checkpoint["rng_states"] = gather_per_rank(trainer, collect_rng_states())
        self._saved_at_step = trainer.global_step

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """This rank's RNG states from the checkpoint (a checkpoint of another number of ranks: rank 0's)."""
        per_rank = checkpoint.get("rng_states") or []
        if per_rank:
            if len(per_rank) != trainer.world_size:
                log.warning("the checkpoint was made by %d processes: the random streams change", len(per_rank))
            restore_rng_states(per_rank[trainer.global_rank] if trainer.global_rank < len(per_rank) else per_rank[0])

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Periodic save; on a pending SIGTERM, save this round (if not saved just now) and stop."""
        super().on_train_epoch_end(trainer, pl_module)
        if self.stop_on_sigterm and trainer.strategy.reduce_boolean_decision(self._sigterm, all=False):
            if self._saved_at_step != trainer.global_step:
                self._save_last_round(trainer)
            rounds = trainer.fit_loop.epoch_progress.current.processed
            log.warning("SIGTERM: stopping after round %d, saved in %s", rounds, self.last_model_path)
            trainer.should_stop = True
        self._take_boundary(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The run is over: ``last.ckpt`` gets its final round even when that is not a multiple of N."""
        if self.save_last and self._saved_at_step != trainer.global_step:
            self._save_last_round(trainer)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """A failure (or SIGTERM) during a rollout: save the last completed round, which nothing has changed."""
        super().on_exception(trainer, pl_module, exception)
        at_boundary, self._at_boundary = self._at_boundary, False  # a SIGTERM from now on only sets the flag
        # Lightning skips the teardown hooks after an exception: the SIGTERM handler is put back here.
        self._restore_handler()
        if not at_boundary or self._boundary is None or trainer.world_size > 1:
            # Mid-round the last completed round is no longer in memory; under data parallelism the other ranks
            # may not be here to take part in a save.
            if self.last_model_path:
                log.warning("the last checkpoint is %s", self.last_model_path)
            return
        rounds = trainer.fit_loop.epoch_progress.current.processed
        if rounds == 0:
            return  # no round completed: nothing to resume from
        self._restore_boundary(trainer, pl_module)
        if self._saved_at_step != trainer.global_step or not self.last_model_path:
            self._save_last_round(trainer)
        log.warning(
            "%s during the rollout of round %d: round %d is saved in %s (resume with --ckpt_path last)",
            "SIGTERM" if isinstance(exception, SIGTERMException) else type(exception).__name__,
            rounds + 1,
            rounds,
            self.last_model_path,
        )

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Put back the SIGTERM handler that was there before ``fit``."""
        self._restore_handler()
        self._at_boundary, self._boundary = False, None

    # ---------------------------------------------------------------------------------------- SIGTERM
    def _install_handler(self, exclusive: bool = False) -> None:
        if not self.stop_on_sigterm or not _in_main_thread():
            return
        current = signal.getsignal(signal.SIGTERM)
        if not self._handler_installed:
            self._previous_handler = current
            self._handler_installed = True
        elif not exclusive:
            return
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _restore_handler(self) -> None:
        if self._handler_installed and _in_main_thread():
            # None: the previous handler was not installed from Python; the default is the closest.
            previous = self._previous_handler if self._previous_handler is not None else signal.SIG_DFL
            signal.signal(signal.SIGTERM, previous)
            self._handler_installed = False

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self._sigterm:
            return  # a second notice while already stopping
        self._sigterm = True
        if self._at_boundary and self._boundary is not None:
            # Nothing of this round is trained yet: abandon the rollout now; on_exception saves the last round.
            raise SIGTERMException()
        log.warning("SIGTERM: finishing this round's update, then saving it and stopping")

    # -------------------------------------------------------------------------------- boundary state
    def _take_boundary(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.world_size > 1:
            self._boundary, self._at_boundary = None, False
            return
        datamodule = trainer.datamodule
        self._boundary = {
            "datamodule": copy.deepcopy(datamodule.state_dict()) if datamodule is not None else None,
            "rng": collect_rng_states(),
        }
        self._at_boundary = True

    def _restore_boundary(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert self._boundary is not None
        if self._boundary["datamodule"] is not None and trainer.datamodule is not None:
            trainer.datamodule.load_state_dict(self._boundary["datamodule"])
        restore_rng_states(self._boundary["rng"])

    def _save_last_round(self, trainer: Trainer) -> None:
        path = self.last_model_path or self.format_checkpoint_name({}, self.CHECKPOINT_NAME_LAST)
        if self.dirpath and Path(path).parent != Path(self.dirpath):
            path = self.format_checkpoint_name({}, self.CHECKPOINT_NAME_LAST)
        self.last_model_path = path  # part of this callback's state, so set before the save
        trainer.save_checkpoint(path, self.save_weights_only)


def _in_main_thread() -> bool:
    # Python accepts signal handlers from the main thread only.
    return threading.current_thread() is threading.main_thread()


# ------------------------------------------------------------------------------------------------ the default
DEFAULT_CHECKPOINT_ROUNDS = 10
"""A config without a checkpoint callback saves ``last.ckpt`` every this many rounds (and at the end, and on
SIGTERM)."""


def default_checkpoint(trainer: Any, callbacks: list[Any], *, rounds: bool) -> ModelCheckpoint | None:
    """The checkpoint callback of a config that names none, so that no run ends with nothing saved.

    Lightning's own default saves at validation when validation is not every epoch: a run validated only at its
    end saved nothing before it. This one keeps ``<default_root_dir>/checkpoints/last.ckpt`` (``--ckpt_path last``
    resumes it): for GRPO a ``RoundCheckpoint`` (every ``DEFAULT_CHECKPOINT_ROUNDS`` rounds, at the end, and the
    last completed round on SIGTERM), for SFT (``rounds=False``) a ``ModelCheckpoint`` at every epoch's end. None
    when the config has a checkpoint callback or ``trainer.enable_checkpointing: false``.
    """
    if trainer.get("enable_checkpointing") is False or any(isinstance(c, ModelCheckpoint) for c in callbacks):
        return None
    folder = os.path.join(str(trainer.get("default_root_dir") or os.getcwd()), "checkpoints")
    if rounds:
        every = DEFAULT_CHECKPOINT_ROUNDS
        checkpoint: ModelCheckpoint = RoundCheckpoint(dirpath=folder, every_n_rounds=every, save_top_k=0)
        when = f"every {every} rounds, at the end and on SIGTERM"
    else:
        checkpoint = ModelCheckpoint(dirpath=folder, save_top_k=0, save_last=True, save_on_train_epoch_end=True)
        when = "at every epoch's end"
    rank_zero_info(
        f"no checkpoint callback in the config: saving {folder}/last.ckpt {when} (resume with --ckpt_path last; "
        "trainer.enable_checkpointing: false turns this off)"
    )
    return checkpoint
