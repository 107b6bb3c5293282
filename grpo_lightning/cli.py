"""The command line: ``python -m grpo_lightning {fit,validate,test} --config configs/....yaml``.

Lightning's ``LightningCLI`` (jsonargparse): every hyperparameter of ``GRPOModule``, ``RolloutDataModule`` and the
``Trainer`` is a YAML key, overridable on the command line; several ``--config`` files compose left to right.
A setting, data file or checkpoint that cannot work ends the run with one line, ``error: ...``, naming it; so does a
service that is down or an environment that crashed, each kind with its own exit status (``main``, ``errors.py``).
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import os
import re
import sys
from pathlib import Path
from typing import Any

from lightning import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from grpo_lightning.callbacks.checkpointing import default_checkpoint
from grpo_lightning.callbacks.progress import default_progress_bar
from grpo_lightning.callbacks.round_log import RoundLog, is_terminal
from grpo_lightning.callbacks.wandb_logger import LoggerSaveConfigCallback
from grpo_lightning.checkpoint_io import AtomicCheckpointIO
from grpo_lightning.config import (
    AdvantageConfig,
    ConfigError,
    EvalConfig,
    ObjectiveConfig,
    SamplingConfig,
    ScheduleConfig,
    UpdateConfig,
)
from grpo_lightning.config_checks import (
    check_checkpoint_hparams,
    check_setting_ranges,
    derive_accumulation,
    read_checkpoint_hparams,
)
from grpo_lightning.distillation import TeacherConfig
from grpo_lightning.errors import UserFacingError
from grpo_lightning.fit_summary import evaluate_arguments, print_fit_summary
from grpo_lightning.lora import LoraConfig
from grpo_lightning.models.tiny import TinyModelConfig
from grpo_lightning.module import GRPOModule
from grpo_lightning.plugins import load_plugin
from grpo_lightning.renamed_keys import PARSER_MODE, migrate_command_line
from grpo_lightning.rewards import RewardSpec
from grpo_lightning.rollout.curriculum import CurriculumConfig
from grpo_lightning.rollout.datamodule import RolloutDataModule

# The settings a GRPO run needs from the Trainer: a fresh rollout every epoch, and no DistributedSampler
# re-splitting a rollout that each rank already built for itself.
TRAINER_DEFAULTS = {
    "reload_dataloaders_every_n_epochs": 1,
    "log_every_n_steps": 1,  # a round has only a few optimizer steps: log every one
    "use_distributed_sampler": False,
    "num_sanity_val_steps": 0,
    # Held-out evaluation decodes every held-out prompt: every round (Lightning's default) would, for a real model,
    # spend more time evaluating than training. A config's own value wins.
    "check_val_every_n_epoch": 10,
}

# The subcommands an integration adds in front of Lightning's: ``python -m grpo_lightning sft fit ...`` runs the CLI
# class at the path (imported then, and only then: ``plugins.load_plugin``).
SUBCOMMANDS: dict[str, str] = {"sft": "grpo_lightning.integrations.sft:SFTCLI"}

# ckpt_path values that Lightning resolves itself (not file paths).
_SPECIAL_CKPT_PATHS = {"last", "best", "hpc", "registry"}

# Where each settings group's keys come from, to suggest the intended key for a mistyped one.
_KEY_SOURCES: dict[str, Any] = {
    "model": GRPOModule.__init__,
    "data": RolloutDataModule.__init__,
    "trainer": Trainer.__init__,
    "model.objective": ObjectiveConfig,
    "model.tiny_model": TinyModelConfig,
    "model.lora": LoraConfig,
    "model.teacher": TeacherConfig,
    "data.sampling": SamplingConfig,
    "data.advantage": AdvantageConfig,
    "data.update": UpdateConfig,
    "data.schedule": ScheduleConfig,
    "data.eval": EvalConfig,
    "data.curriculum": CurriculumConfig,
    "data.rewards": RewardSpec,
}


class GRPOCLI(LightningCLI):
    """``LightningCLI`` with GRPO's Trainer defaults, one-line errors and early checkpoint checks.

    Every run gets a line per round in its log (``RoundLog``), round-boundary checkpoints and the
    ``AtomicCheckpointIO`` plugin, unless its config has its own; ``trainer.accumulate_grad_batches`` follows from
    ``data.update.mini_batch_size / data.update.micro_batch_size`` when the config leaves it unset.
    """

    epochs_are_rounds: bool = True
    """Each epoch is one rollout round: the accumulation follows from the batch sizes (``derive_accumulation``) and
    the fit's summary counts rounds. A subcommand's CLI (``SUBCOMMANDS``: SFT's, epochs over a dataset) sets it
    False."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not args and "model_class" not in kwargs:
            args = (GRPOModule, RolloutDataModule)
        kwargs.setdefault("seed_everything_default", 0)
        kwargs.setdefault("trainer_defaults", TRAINER_DEFAULTS)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        # Records the full resolved config with the run (W&B config and files), not only the module's settings.
        kwargs.setdefault("save_config_callback", LoggerSaveConfigCallback)
        argv = kwargs.get("args")  # as LightningCLI reads it: None = the process's command line
        self.command_line = (
            list(sys.argv[1:] if argv is None else argv) if isinstance(argv, (list, type(None))) else None
        )
        if self.command_line is not None:  # flags of keys that moved (``renamed_keys``), spelled as now
            self.command_line = migrate_command_line(self.command_line)
            if argv is None:
                sys.argv[1:] = self.command_line
            else:
                kwargs["args"] = self.command_line
        check_ckpt_file(self.command_line)
        super().__init__(*args, **kwargs)

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """Parsers that raise on a bad setting (``main`` prints one line) instead of printing the whole usage, and
        read the keys of earlier layouts (``renamed_keys``) with a warning."""
        kwargs.setdefault("exit_on_error", False)
        kwargs.setdefault("parser_mode", PARSER_MODE)
        return super().init_parser(**kwargs)

    def before_instantiate_classes(self) -> None:
        """Checkpoint and log folders that the config leaves unset go under ``trainer.default_root_dir``; numeric
        settings out of range are refused before anything is built (``config_checks.SETTING_RANGES``); the
        gradient accumulation is derived from the batch sizes (``derive_accumulation``); with ``--ckpt_path``, the
        config's model settings apply and a checkpoint of another model is refused."""
        config = self.config.get(str(self.subcommand), self.config)
        keep_config_model_settings(self, config)
        check_setting_ranges(config)
        if self.epochs_are_rounds:
            derive_accumulation(config)
        place_run_folders(config.get("trainer"))

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The Trainer, with what a run needs and its config may leave out (``default_callbacks``) and the
        ``AtomicCheckpointIO`` plugin; the progress bar only on a terminal (``RoundLog`` writes a line per round
        to a log file instead); a setting that Lightning refuses (``devices=0``, ``strategy='bogus'``, ...) as one
        line."""
        config = self.config_init.get(str(self.subcommand), self.config_init)
        trainer = config.get("trainer") or {}
        callbacks = trainer.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
        added = self.default_callbacks(trainer, callbacks)
        if added:
            kwargs.setdefault("callbacks", [*callbacks, *added])
        if trainer.get("enable_progress_bar") is None and not is_terminal():
            if not any(isinstance(c, ProgressBar) for c in callbacks):
                kwargs.setdefault("enable_progress_bar", False)
        plugins = trainer.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, list) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            kwargs.setdefault("plugins", [*plugins, AtomicCheckpointIO()])
        try:
            return super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, ValueError, TypeError) as err:
            if user_error(err) is not None:
                raise
            raise trainer_error(err, config.get("trainer")) from err

    def default_callbacks(self, trainer: Any, callbacks: list[Any]) -> list[Any]:
        """What a GRPO run needs that ``callbacks`` lacks: ``RoundLog`` (a line per round in a log file), a
        ``RoundProgressBar`` where a bar is shown
        (``default_progress_bar``) and, unless ``trainer.enable_checkpointing`` is false, a ``RoundCheckpoint``
        keeping ``<default_root_dir>/checkpoints/last.ckpt`` (``default_checkpoint``)."""
        added: list[Any] = []
        if not any(isinstance(c, RoundLog) for c in callbacks):
            added.append(RoundLog())
        extra = (default_progress_bar(trainer, callbacks), default_checkpoint(trainer, callbacks, rounds=True))
        return added + [c for c in extra if c is not None]

    def before_fit(self) -> None:
        """GRPO's own Trainer requirement, checked before anything is built."""
        reload = self.trainer.reload_dataloaders_every_n_epochs
        if reload != 1:
            raise ConfigError(
                f"trainer.reload_dataloaders_every_n_epochs must be 1 for GRPO (got {reload}): each epoch is one "
                "rollout round"
            )

    def after_fit(self) -> None:
        """The run's last lines, after W&B's: rounds done, the last reward and held-out accuracy, where
        ``last.ckpt`` is and the commands that evaluate and export it (``fit_summary``)."""
        config = self.config.get(str(self.subcommand), self.config)
        arguments = evaluate_arguments(self.command_line, config.get("config") or [])
        print_fit_summary(self.trainer, arguments, sft=not self.epochs_are_rounds)


def check_ckpt_file(command_line: list[str] | None) -> None:
    """A ``--ckpt_path`` on the command line that is no readable checkpoint file, as one line, before Lightning
    reads it."""
    if not command_line:
        return
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--ckpt_path")
    known, _ = parser.parse_known_args(command_line)
    path = known.ckpt_path
    if not path or path in _SPECIAL_CKPT_PATHS or "://" in path or path == "null":
        return
    if not Path(path).is_file():
        raise ConfigError(f"ckpt_path: no such checkpoint file {path!r}")
    read_checkpoint_hparams(path)  # not a checkpoint at all: one line


def keep_config_model_settings(cli: GRPOCLI, config: Any) -> None:
    """With ``--ckpt_path FILE``: the config's model settings apply, and a checkpoint of another model is refused.

    ``LightningCLI`` itself replaces the model settings of the config with the checkpoint's, silently: a resumed
    run would ignore, say, a new ``model.lr``. Here the command line is parsed again and its model settings put
    back; a checkpoint of another model is refused now, in one line, and other changed settings are listed in a
    warning when it loads.
    """
    ckpt_path = config.get("ckpt_path")
    if not ckpt_path or str(ckpt_path) in _SPECIAL_CKPT_PATHS or "://" in str(ckpt_path):
        return
    saved = read_checkpoint_hparams(str(ckpt_path)) or {}
    if cli.command_line is not None:
        fresh = cli.parser.parse_args(cli.command_line)
        config["model"] = fresh.get(str(cli.subcommand), fresh)["model"]
    model = config.get("model")
    current = model.as_dict() if hasattr(model, "as_dict") else dict(model or {})
    current = current.get("init_args", current)  # class_path form, with subclass mode
    check_checkpoint_hparams(saved, current, repr(str(ckpt_path)))


def _class_of(item: Any) -> type | None:
    """The class a ``{class_path, init_args}`` entry of the parsed config names (None when it names none)."""
    path = item.get("class_path") if hasattr(item, "get") else None
    if not isinstance(path, str) or "." not in path:
        return None
    module, _, name = path.rpartition(".")
    try:
        return load_plugin(f"{module}:{name}")
    except (ImportError, AttributeError):  # reported when the class is instantiated
        return None


def place_run_folders(trainer: Any) -> None:
    """Under ``trainer.default_root_dir`` (when set), the folders of a run that its config leaves unset.

    A checkpoint callback (``ModelCheckpoint``, ``RoundCheckpoint``) without ``dirpath`` writes to
    ``<default_root_dir>/checkpoints``; a logger whose ``save_dir`` is unset or ``.`` (W&B's default) writes under
    ``<default_root_dir>``. ``--trainer.default_root_dir runs/a`` then moves everything a run writes, so two runs
    of one config are told apart on the command line. Folders the config sets explicitly stay as they are.
    ``trainer``: the parsed config's ``trainer`` section (changed in place).
    """
    root = trainer.get("default_root_dir") if trainer is not None else None
    if not root:
        return
    try:  # a folder the run cannot write would otherwise fail at the first checkpoint, after training
        os.makedirs(root, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"trainer.default_root_dir: cannot create {root} ({err.strerror}); choose a folder this user can write"
        ) from None
    callbacks, loggers = trainer.get("callbacks") or [], trainer.get("logger")
    for item in callbacks if isinstance(callbacks, list) else [callbacks]:
        cls, init_args = _class_of(item), item.get("init_args") if hasattr(item, "get") else None
        if cls is not None and issubclass(cls, ModelCheckpoint) and init_args is not None:
            if init_args.get("dirpath") is None:
                init_args["dirpath"] = os.path.join(str(root), "checkpoints")
    for item in loggers if isinstance(loggers, list) else [loggers]:
        init_args = item.get("init_args") if _class_of(item) is not None else None
        if init_args is not None and "save_dir" in init_args and init_args.get("save_dir") in (None, "."):
            init_args["save_dir"] = str(root)


def trainer_error(err: BaseException, settings: Any) -> ConfigError:
    """Lightning's refusal of a Trainer setting, as a ``ConfigError`` whose one line names the setting.

    The setting is the first Trainer argument the message names (``devices``, ``strategy``, ...), else the one
    whose value it quotes (``accelerator: gpu`` -> "No supported gpu backend found!").
    """
    message = " ".join(str(err).split()) or type(err).__name__
    names = [n for n in inspect.signature(Trainer.__init__).parameters if n not in ("self", "args", "kwargs")]
    found = sorted((m.start(), n) for n in names if (m := re.search(rf"\b{n}\b", message)))
    if not found and settings is not None:
        values = {n: settings.get(n) if hasattr(settings, "get") else getattr(settings, n, None) for n in names}
        found = sorted(
            (m.start(), n)
            for n, v in values.items()
            if isinstance(v, str) and v and (m := re.search(rf"(?<![\w-]){re.escape(v)}(?![\w-])", message))
        )
    where = f"trainer.{found[0][1]}" if found else "trainer"
    return ConfigError(f"{where}: {message}")


def user_error(err: BaseException) -> UserFacingError | None:
    """The error behind ``err`` that is the user's to fix (a ``UserFacingError``: settings, data, rewards, a
    service, an environment, numerics), if any.

    jsonargparse wraps the ones raised while parsing, hence the walk along the cause chain.
    """
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, UserFacingError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _suggest(key: str) -> str:
    """`` (did you mean 'x.y'?)`` for a mistyped ``key`` whose group is known, else an empty string."""
    group, _, leaf = key.rpartition(".")
    source = _KEY_SOURCES.get(group)
    if source is None:
        return ""
    names = [n for n in inspect.signature(source).parameters if n not in ("self", "args", "kwargs")]
    close = difflib.get_close_matches(leaf, names, n=1, cutoff=0.6)
    return f" (did you mean '{group}.{close[0]}'?)" if close else ""


def parse_error_line(message: str) -> str:
    """jsonargparse's (often multi-line, nested) message about a bad setting, as one line that names it."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return "invalid arguments"
    match = re.match(r'Parser key "([^"]+)":\s*(.*)', lines[0])
    key, rest = (match.group(1), [match.group(2), *lines[1:]]) if match else (None, lines)
    text = " ".join(rest)
    unknown = re.search(r"unrecognized arguments: --?([\w.\-]+)", text) or re.search(
        r"does not accept option '([^']+)'", text
    )
    if unknown:
        return f"unknown setting '{unknown.group(1)}'{_suggest(unknown.group(1))}"
    option = re.search(r"Option '([^']+)' is not accepted", text)
    if key and option:
        name = f"{key}.{option.group(1)}"
        return f"{key}: unknown key '{option.group(1)}'{_suggest(name)}"
    expected = re.search(r"Expected a <class '(\w+)'>\. Got value: (.*?)(?: - |$)", text)
    if key and expected:
        return f"{key}: expected a {expected.group(1)}, got {expected.group(2).strip()!r}"
    problem = re.search(r"Problem with given class_path '([^']+)':\s*(.+?)(?:\s+- |\s+Given value|$)", text)
    if key and problem:
        return f"{key}: {problem.group(1)}: {problem.group(2)}"
    # A value none of a Union of fixed choices accepts (trainer.precision: 17): list the choices.
    subtypes = re.search(r"Subtypes: \[(.*)\] Errors:", text)
    given = re.search(r"Given value: (.*?)$", text)
    if key and subtypes and given:
        literals = re.findall(r"typing\.Literal\[([^\]]*)\]", subtypes.group(1))
        rest = re.sub(r"typing\.Literal\[[^\]]*\]|<class 'NoneType'>|[,\s]", "", subtypes.group(1))
        if literals and not rest:
            choices = [c.strip() for inner in literals for c in inner.split(",")]
            choices += ["null"] if "NoneType" in subtypes.group(1) else []
            return f"{key}: got {given.group(1).strip()!r}; expected one of {', '.join(dict.fromkeys(choices))}"
    detail = next((line for line in rest if line and not line.startswith(("-", "Subtypes", "Errors"))), text)
    line = f"{key}: {detail}" if key else detail
    return line if len(line) <= 300 else line[:297] + "..."


def main(args: list[str] | None = None) -> None:
    """Entry point: a fault the user can fix (``errors.UserFacingError``) ends the run with one line, ``error:
    ...``, not a traceback, and an exit status that says which kind it was:

    - 0: done, or stopped by SIGTERM after saving its checkpoint;
    - 1: stopped by non-finite values (``NonFiniteError``);
    - 2: a bad setting, data file, model/teacher/dataset path or reward function (``ConfigError``, ``RewardError``);
    - 3: a service the run talks to is down, silent or refusing: a vLLM server, a served teacher, an OpenEnv server
      (``ServiceError``);
    - 4: an environment or tool failed: a server the run started exited, the environment raised, a tool or its
      sandbox is broken (``EnvironmentCrashed``).

    Anything else is a bug: a traceback (exit status 1). Set ``GRPO_DEBUG=1`` for full tracebacks.
    ``python -m grpo_lightning sft fit|validate ...`` runs supervised fine-tuning (``grpo_lightning.integrations.sft``)
    instead.
    """
    argv = sys.argv[1:] if args is None else list(args)
    cli_class = GRPOCLI
    if argv and argv[0] in SUBCOMMANDS:  # an integration's subcommand (``sft``): its own CLI class
        cli_class, argv = load_plugin(SUBCOMMANDS[argv[0]]), argv[1:]
    try:
        if args is None:  # the process's own command line: LightningCLI reads it (given both, it warns)
            sys.argv[1:] = argv
            cli_class()
        else:
            cli_class(args=argv)
    except Exception as err:
        if os.environ.get("GRPO_DEBUG"):
            raise
        cause = user_error(err)  # also behind jsonargparse's errors, when a settings class refused a value
        if cause is not None:
            print(f"error: {' '.join(str(cause).split())}", file=sys.stderr)  # one line, whatever the message
            sys.exit(cause.exit_code)
        if isinstance(err, argparse.ArgumentError):  # a bad setting, from jsonargparse
            print(f"error: {parse_error_line(str(err))}", file=sys.stderr)
            sys.exit(2)
        raise


def __getattr__(name: str) -> type[GRPOCLI]:
    # ``from grpo_lightning.cli import SFTCLI`` as before: SFT's CLI class, imported when asked for.
    if name == "SFTCLI":
        return load_plugin(SUBCOMMANDS["sft"])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
