"""W&B without surprises: online when this machine has W&B credentials, offline otherwise, never a login prompt.

``GRPOWandbLogger`` is Lightning's ``WandbLogger`` that picks its mode itself (``wandb_mode``) and saves the
package's source code with the run; ``LoggerSaveConfigCallback`` records the full ``LightningCLI`` config (trainer,
model, data) in every logger's hyperparameters and stores ``config.yaml`` with the W&B run.
"""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml
from lightning import LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import WandbLogger

import grpo_lightning

DEFAULT_HOST = "https://api.wandb.ai"


def has_wandb_credentials(environ: dict[str, str] | None = None) -> bool:
    """Whether W&B can authenticate without asking: ``WANDB_API_KEY`` or ``WANDB_IDENTITY_TOKEN_FILE`` is set, or
    the netrc file (``$NETRC``, default ``~/.netrc``, where ``wandb login`` writes) has an entry for the W&B host
    (``WANDB_BASE_URL``, default api.wandb.ai)."""
    environ = os.environ if environ is None else environ
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(environ.get("WANDB_BASE_URL") or DEFAULT_HOST).hostname or ""
    path = environ.get("NETRC") or str(Path.home() / ".netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):  # no file, or one that wandb could not read either
        return False


def wandb_mode(offline: bool | None = None, environ: dict[str, str] | None = None) -> str | None:
    """The ``mode`` to start W&B in: ``None`` lets ``WANDB_MODE`` decide when it is set, otherwise ``"offline"``
    when ``offline`` is true or no credentials are found (``has_wandb_credentials``), else ``"online"``."""
    environ = os.environ if environ is None else environ
    if offline is True:
        return "offline"
    if environ.get("WANDB_MODE"):
        return None
    if offline is False:
        return "online"
    return "online" if has_wandb_credentials(environ) else "offline"


class GRPOWandbLogger(WandbLogger):
    """``WandbLogger`` that is online when logged in and offline otherwise, and saves the code with the run.

    An offline run is uploaded later with ``wandb sync <save_dir>/wandb/offline-run-*``. The code is logged as a
    W&B code artifact (the run's "Code" tab) of every ``.py`` file under ``code_dir``.
    """

    def __init__(
        self,
        name: str | None = None,
        save_dir: str = ".",
        project: str | None = None,
        offline: bool | None = None,
        log_code: bool = True,
        code_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        """
        Args:
            name: display name of the run.
            save_dir: folder of the ``wandb/`` run directories.
            project: W&B project (default: ``$WANDB_PROJECT`` or ``lightning_logs``).
            offline: ``None`` = decide (``WANDB_MODE`` if set, else online only with credentials); ``True`` =
                offline; ``False`` = online.
            log_code: save the source code with the run.
            code_dir: the folder whose ``.py`` files are saved; default: the ``grpo_lightning`` package.
            kwargs: other ``WandbLogger`` / ``wandb.init`` arguments (``tags``, ``group``, ``entity``, ...).
        """
        # LightningCLI passes every wandb.init argument, unset ones as None: drop those, so that they neither hide
        # the mode chosen here nor Lightning's own defaults (resume="allow").
        kwargs = {key: value for key, value in kwargs.items() if value is not None}
        mode = wandb_mode(offline)
        if mode is not None:
            kwargs.setdefault("mode", mode)
        # Lightning's own offline flag rewrites WANDB_MODE process-wide; passing ``mode`` keeps it to this run.
        super().__init__(name=name, save_dir=save_dir, project=project, offline=False, **kwargs)
        # Unset wandb.init arguments mean "W&B's default"; passing them as None only earns warnings (anonymous).
        self._wandb_init = {key: value for key, value in self._wandb_init.items() if value is not None}
        self.log_code, self.code_dir = log_code, code_dir
        self._code_logged = False

    @property
    def experiment(self) -> Any:
        """The W&B run (created on first use; its code artifact is logged then)."""
        run = super().experiment
        if self.log_code and not self._code_logged and hasattr(run, "log_code"):
            self._code_logged = True
            root = self.code_dir or str(Path(grpo_lightning.__file__).parent)
            run.log_code(root=root, name="source-code", include_fn=lambda path, root=None: path.endswith(".py"))
        return run


def config_sections(config: dict[str, Any]) -> dict[str, Any]:
    """The config's top-level sections (``trainer``, ``model``, ``data``, ...) as nested W&B config entries."""
    return {key: value for key, value in config.items() if key != "config"}  # "config" = the --config file paths


class LoggerSaveConfigCallback(SaveConfigCallback):
    """``SaveConfigCallback`` that also gives the full resolved config to every logger.

    Each logger's ``log_hyperparams`` receives the config's sections (so W&B's run config shows ``trainer``,
    ``model``, ``data``, ``seed_everything``), and a W&B run also stores the ``config.yaml`` file.
    Use it with ``LightningCLI(save_config_callback=LoggerSaveConfigCallback)``.
    """

    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Runs on rank 0 only (``SaveConfigCallback.setup`` calls it there): nothing here may be a collective."""
        if not trainer.loggers:
            return
        config = yaml.safe_load(self.parser.dump(self.config, skip_none=False))
        for logger in trainer.loggers:
            logger.log_hyperparams(config_sections(config))
            if isinstance(logger, WandbLogger) and hasattr(logger.experiment, "save"):
                self._save_config_file(logger.experiment)

    def _save_config_file(self, run: Any) -> None:
        # Written into the run's own folder (the file in the log folder may be overwritten by the next run) from
        # the parsed config, not copied from ``trainer.log_dir``: ``save_config`` runs on rank 0 only, and
        # ``trainer.log_dir`` is a collective (a broadcast from rank 0) that the other ranks would never join.
        # Every later collective of rank 0 would then pair with an earlier one of theirs, until one waits forever
        # (rank 0 in ``ModelCheckpoint.setup``'s broadcast, the others at Lightning's post-setup barrier).
        target = Path(run.dir) / self.config_filename
        self.parser.save(self.config, str(target), skip_none=False, overwrite=True)
        run.save(str(target), base_path=run.dir, policy="now")
