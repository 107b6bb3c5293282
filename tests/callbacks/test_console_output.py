"""What a person sees on a terminal names what the rest of the run names: the progress bar counts rounds from 1
(``Round 40/40``, not ``Epoch 39/39``) and prints rates as whole numbers, and every ``fit`` ends with a summary of
what it reached, where ``last.ckpt`` is and the commands that evaluate and export it (commands that work)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
import wandb
from export_hf import main as export_main
from lightning import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, TQDMProgressBar
from test_cli import TINY_CONFIG, write_config

from grpo_lightning.callbacks import RoundProgressBar, SaveHFModel
from grpo_lightning.callbacks.progress import round_description
from grpo_lightning.cli import GRPOCLI, SFTCLI, main
from grpo_lightning.fit_summary import evaluate_arguments, fit_summary

ROOT = Path(__file__).resolve().parents[2]
ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def screen(text: str) -> str:
    """Terminal output as the lines it drew: escape codes out, each carriage-return redraw a line of its own."""
    return ESCAPES.sub("", text).replace("\r", "\n")


@pytest.fixture
def terminal(tmp_path, monkeypatch):
    """The captured output passes for a terminal 200 columns wide (Rich draws its live bar only on one), in a
    scratch working directory, W&B offline and its folders out of the home directory."""
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    wandb.finish()


def test_the_quickstart_on_a_terminal_says_round_and_ends_with_a_summary_whose_commands_work(terminal, capsys):
    config = str(ROOT / "configs" / "quickstart.yaml")
    model = ["--model.model_name_or_path", str(ROOT / "grpo_lightning" / "assets" / "tiny-arith")]
    short = ["--trainer.max_epochs", "2", "--trainer.check_val_every_n_epoch", "2", "--data.eval.limit", "20"]
    main(["fit", "--config", config, *model, *short, "--trainer.enable_progress_bar", "true"])
    captured = capsys.readouterr()
    out = screen(captured.out)

    # The bar: rounds from 1, never epochs; the throughputs as whole numbers.
    assert re.search(r"Round 1/2\b", out) and re.search(r"Round 2/2\b", out), out[-3000:]
    assert "Epoch" not in out + captured.err
    assert re.search(r"gen_tok/s: \d+\s", out) and re.search(r"train_tok/s: \d+\s", out), out[-3000:]
    assert not re.search(r"tok/s: \d+\.", out)
    assert wandb.run is None  # W&B finished its run (and printed its lines) before the summary

    # The summary: the run's last lines.
    lines = [line for line in out.splitlines() if line.strip()][-4:]
    summary = r"Finished 2/2 rounds: reward ([\d.]+), held-out accuracy ([\d.]+)% \(last evaluation\)"
    done = re.fullmatch(summary, lines[0])
    assert done, lines
    last = "runs/quickstart/checkpoints/last.ckpt"  # relative to the working directory, as the README writes it
    assert lines[1] == f"  last.ckpt  {last}" and (terminal / last).is_file()
    settings = ["--config", config, *model, *short, "--trainer.enable_progress_bar", "true"]
    evaluate = ["python", "-m", "grpo_lightning", "validate", *settings, "--ckpt_path", last]
    assert lines[2] == f"  evaluate   {shlex.join(evaluate)}"
    export = ["python", "tools/export_hf.py", last, "runs/quickstart/hf"]
    assert lines[3] == f"  export     {shlex.join(export)}"

    # The commands as printed: validate gives the accuracy the summary reports; export writes a Hugging Face folder.
    validated = GRPOCLI(args=shlex.split(lines[2])[4:])  # evaluate python -m grpo_lightning [validate ...]
    assert f"{100 * float(validated.trainer.callback_metrics['val/accuracy']):.1f}" == done.group(2)
    export_main(shlex.split(lines[3])[3:])  # export python tools/export_hf.py [ckpt out]
    assert (terminal / "runs" / "quickstart" / "hf" / "config.json").is_file()


def test_an_sft_fit_ends_with_its_summary_too(terminal, capsys):
    (terminal / "pairs.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+1=", "response": str(a + 1)}) + "\n"
                                                  for a in range(16)))  # fmt: skip
    trainer = {"accelerator": "cpu", "max_epochs": 1, "logger": False, "enable_progress_bar": False}
    data = {"dataset": "pairs.jsonl", "batch_size": 4, "max_length": 32, "sampling": {"max_new_tokens": 4}}
    data.update(val_dataset="arithmetic", eval={"limit": 8}, task_kwargs={"test_size": 50})
    config = {
        "trainer": {**trainer, "enable_model_summary": False, "default_root_dir": "sft"},
        "model": {"tiny_model": TINY_CONFIG["model"]["tiny_model"], "lr": 1e-3},
        "data": data,
    }
    write_config(terminal / "sft.yaml", config)
    main(["sft", "fit", "--config", "sft.yaml", "--trainer.check_val_every_n_epoch", "1"])
    lines = [line for line in screen(capsys.readouterr().out).splitlines() if line.strip()][-4:]
    assert re.fullmatch(r"Finished 1/1 epoch, 4 steps: train loss \S+, held-out accuracy [\d.]+% \(last evaluation\)",
                        lines[0]), lines  # fmt: skip
    last = "sft/checkpoints/last.ckpt"
    assert lines[1] == f"  last.ckpt  {last}" and (terminal / last).is_file()
    settings = ["--config", "sft.yaml", "--trainer.check_val_every_n_epoch", "1", "--ckpt_path", last]
    assert lines[2] == f"  evaluate   {shlex.join(['python', '-m', 'grpo_lightning', 'sft', 'validate', *settings])}"
    assert lines[3].startswith("  export     grpo_lightning.callbacks.SaveHFModel in trainer.callbacks")
    validated = SFTCLI(args=shlex.split(lines[2])[5:])
    assert 0.0 <= float(validated.trainer.callback_metrics["val/accuracy"]) <= 1.0


def test_the_round_bar_is_the_default_only_where_a_bar_is_shown_and_a_configs_own_wins(tmp_path):
    """Under pytest standard error is no terminal: with ``enable_progress_bar`` unset the command line shows no bar."""
    grpo = write_config(tmp_path / "grpo.yaml", TINY_CONFIG)  # enable_progress_bar: false
    grpo_config = json.loads(json.dumps(TINY_CONFIG))
    del grpo_config["trainer"]["enable_progress_bar"]
    unset = write_config(tmp_path / "unset.yaml", grpo_config)

    def bar(cli_class: type[GRPOCLI], *args: str) -> object:
        cli = cli_class(args=[*args, "--trainer.default_root_dir", str(tmp_path)], run=False)
        return cli.trainer.progress_bar_callback

    assert bar(GRPOCLI, "--config", str(unset)) is None  # a log file: RoundLog's lines instead
    assert bar(GRPOCLI, "--config", str(grpo)) is None
    assert type(bar(GRPOCLI, "--config", str(unset), "--trainer.enable_progress_bar", "true")) is RoundProgressBar
    own = ["--trainer.callbacks+=lightning.pytorch.callbacks.TQDMProgressBar", "--trainer.enable_progress_bar", "true"]
    assert type(bar(GRPOCLI, "--config", str(unset), *own)) is TQDMProgressBar
    # SFT counts epochs: Lightning's own bar.
    sft = {"trainer": {"accelerator": "cpu", "logger": False, "enable_progress_bar": True},
           "model": {"tiny_model": TINY_CONFIG["model"]["tiny_model"]}, "data": {"dataset": "arithmetic"}}  # fmt: skip
    assert type(bar(SFTCLI, "--config", str(write_config(tmp_path / "sft.yaml", sft)))) is RichProgressBar


def test_the_round_bar_counts_from_one_and_shows_whole_rates_as_integers():
    assert round_description(39, 40) == "Round 40/40" and round_description(4, -1) == "Round 5"
    trainer = Trainer(logger=False, callbacks=[RoundProgressBar()], max_epochs=3)
    trainer.progress_bar_metrics.update({"gen_tok/s": 23754.0, "reward": 0.5, "train_tok/s": torch.tensor(812.0)})
    items = trainer.progress_bar_callback.get_metrics(trainer, None)
    assert items == {"gen_tok/s": "23754", "reward": 0.5, "train_tok/s": "812"}


def test_the_summary_names_the_best_checkpoint_without_a_last_one_and_a_folder_save_hf_model_wrote(tmp_path):
    best, sharded = tmp_path / "epoch=2.ckpt", tmp_path / "sharded.ckpt"  # FSDP2 saves a folder
    sharded.mkdir()
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path), save_last=False)
    checkpoint.best_model_path = str(best)
    trainer = Trainer(logger=False, callbacks=[checkpoint], max_epochs=3, default_root_dir=str(tmp_path))
    assert fit_summary(trainer, [])[1:] == [
        f"  checkpoint {best}",
        f"  evaluate   python -m grpo_lightning validate --ckpt_path {best}",
        f"  export     python tools/export_hf.py {best} {tmp_path / 'hf'}",
    ]
    checkpoint.last_model_path = str(sharded)
    assert fit_summary(trainer, [])[3] == f"  export     python tools/consolidate_fsdp.py {sharded} {tmp_path / 'hf'}"
    trainer = Trainer(logger=False, callbacks=[checkpoint, SaveHFModel(str(tmp_path / "out"))], max_epochs=3)
    assert (
        fit_summary(trainer, [], sft=True)[3] == f"  exported   {tmp_path / 'out'} (a Hugging Face folder, SaveHFModel)"
    )


def test_the_summary_says_when_no_checkpoint_was_written_and_keeps_the_fits_settings():
    trainer = Trainer(logger=False, enable_checkpointing=False, max_epochs=3)
    lines = fit_summary(trainer, ["--config", "c.yaml"])
    assert lines == ["Stopped after 0/3 rounds", "  last.ckpt  none written (trainer.enable_checkpointing: false)"]
    command_line = ["fit", "--config", "c.yaml", "--ckpt_path", "last", "--model.lr", "1e-4", "--ckpt_path=x.ckpt"]
    assert evaluate_arguments(command_line, []) == ["--config", "c.yaml", "--model.lr", "1e-4"]
    assert evaluate_arguments(None, [Path("a.yaml"), "b.yaml"]) == ["--config", "a.yaml", "--config", "b.yaml"]
