"""The lines a ``fit`` from the command line ends with: what the run reached, where its model is, what to run next.

Why: a run used to end on W&B's sync hint, and its reader had to know where ``last.ckpt`` goes and how to evaluate
or export it. After ``fit`` (``GRPOCLI.after_fit``), W&B finishes its run, so that its closing lines come first,
and rank 0 prints::

    Finished 40/40 rounds: reward 0.875, held-out accuracy 98.2% (last evaluation)
      last.ckpt  runs/quickstart/checkpoints/last.ckpt
      evaluate   python -m grpo_lightning validate --config configs/quickstart.yaml --ckpt_path runs/quick...
      export     python tools/export_hf.py runs/quickstart/checkpoints/last.ckpt runs/quickstart/hf

The evaluate command repeats the fit's own settings (the config files and flags but ``--ckpt_path``): ``validate``
refuses a checkpoint of a model other than the one its settings describe.
"""

from __future__ import annotations

import math
import os
import shlex
from typing import Any

from lightning import Trainer
from lightning.pytorch.loggers import WandbLogger

from grpo_lightning.callbacks.export import SaveHFModel

PROGRAM = "python -m grpo_lightning"


def _metric(trainer: Trainer, key: str) -> float | None:
    value = trainer.callback_metrics.get(key)
    value = float(value) if value is not None else None
    return None if value is None or math.isnan(value) else value


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it lies below it (as the README's commands write it)."""
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive
        return path
    return path if relative.startswith("..") else relative


def _row(label: str, text: str) -> str:
    return f"  {label:<10} {text}"


def evaluate_arguments(command_line: list[str] | None, config_files: list[Any]) -> list[str]:
    """The fit's settings for ``validate``: its command line without the subcommand and ``--ckpt_path``; the
    config files alone when the run had no command line (``GRPOCLI(args={...})``)."""
    if command_line is None:
        return [arg for path in config_files for arg in ("--config", str(path))]
    arguments, rest = [], list(command_line)
    if "fit" in rest:
        rest.remove("fit")
    while rest:
        arg = rest.pop(0)
        if arg == "--ckpt_path":
            rest = rest[1:]
        elif not arg.startswith("--ckpt_path="):
            arguments.append(arg)
    return arguments


def checkpoint_path(trainer: Trainer) -> tuple[str, str] | None:
    """``("last.ckpt", path)`` of the run's newest ``last`` checkpoint, else ``("checkpoint", path)`` of its best
    one; None when no checkpoint callback wrote one."""
    callbacks = trainer.checkpoint_callbacks
    last = next((c.last_model_path for c in callbacks if getattr(c, "last_model_path", "")), None)
    if last:
        return "last.ckpt", last
    best = next((c.best_model_path for c in callbacks if getattr(c, "best_model_path", "")), None)
    return ("checkpoint", best) if best else None


def fit_summary(trainer: Trainer, arguments: list[str], sft: bool = False) -> list[str]:
    """The summary's lines. ``arguments``: the fit's settings (``evaluate_arguments``); ``sft``: the run was
    ``python -m grpo_lightning sft fit`` (epochs, not rounds; no ``tools/export_hf.py``, which loads GRPO
    checkpoints)."""
    unit = "epoch" if sft else "round"
    done, total = trainer.current_epoch, trainer.max_epochs
    count = f"{done}/{total}" if total is not None and total > 0 else f"{done}"
    finished = "Finished" if total is None or total <= 0 or done >= total else "Stopped after"
    results = []
    reward = _metric(trainer, "rollout/reward_mean")
    loss = _metric(trainer, "train/loss") if reward is None else None
    if reward is not None:
        results.append(f"reward {reward:.3f}")
    elif loss is not None:
        results.append(f"train loss {loss:.4g}")
    accuracy = _metric(trainer, "val/accuracy")
    if accuracy is not None:
        results.append(f"held-out accuracy {100 * accuracy:.1f}% (last evaluation)")
    plural = "" if (total if total is not None and total > 0 else done) == 1 else "s"
    steps = f", {trainer.global_step} steps" if sft else ""  # SFT often stops at max_steps, inside an epoch
    lines = [f"{finished} {count} {unit}{plural}{steps}" + (f": {', '.join(results)}" if results else "")]
    found = checkpoint_path(trainer)
    if found is None:
        off = not trainer.checkpoint_callbacks
        lines.append(_row("last.ckpt", "none written" + (" (trainer.enable_checkpointing: false)" if off else "")))
        return lines
    label, path = found
    program = f"{PROGRAM} sft" if sft else PROGRAM
    validate = [*program.split(), "validate", *arguments, "--ckpt_path", _shown(path)]
    lines += [_row(label, _shown(path)), _row("evaluate", shlex.join(validate))]
    hf = next((c.dirpath for c in trainer.callbacks if isinstance(c, SaveHFModel)), None)
    if hf is not None:
        lines.append(_row("exported", f"{_shown(hf)} (a Hugging Face folder, SaveHFModel)"))
    elif sft:
        lines.append(
            _row("export", "grpo_lightning.callbacks.SaveHFModel in trainer.callbacks (a Hugging Face folder)")
        )
    else:
        tool = "tools/consolidate_fsdp.py" if os.path.isdir(path) else "tools/export_hf.py"  # FSDP: a folder
        out = os.path.join(trainer.default_root_dir, "hf")
        lines.append(_row("export", shlex.join(["python", tool, _shown(path), _shown(out)])))
    return lines


def finish_wandb(trainer: Trainer) -> None:
    """Ends the W&B run now rather than at the process's exit, so that W&B's closing lines (``wandb sync ...``)
    come before the summary, the run's last lines."""
    if any(isinstance(logger, WandbLogger) for logger in trainer.loggers):
        import wandb

        if wandb.run is not None:
            wandb.finish()


def print_fit_summary(trainer: Trainer, arguments: list[str], sft: bool = False) -> None:
    """Finishes the W&B run, then prints ``fit_summary`` on rank 0, to standard output (flushed: a log file gets it
    before the process ends)."""
    finish_wandb(trainer)
    if trainer.is_global_zero:
        print("\n".join(fit_summary(trainer, arguments, sft)), flush=True)
