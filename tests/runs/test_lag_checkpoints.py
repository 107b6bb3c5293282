"""Checkpoints inside a round at a rollout lag (issue 39, point 4): refused before training, in one line.

At ``data.schedule.rollout_lag`` ≥ 1 a checkpoint holds the rounds sampled ahead, not the rollout in training; a run
resumed from inside a round used to fail at its first step ("the rollout schedule waits for a round it never launched").
A checkpoint callback that saves there (``every_n_train_steps``, ``train_time_interval``, or after a validation run
inside a round) is now refused when ``fit`` starts, before any round is drawn, through the Python API and the CLI;
round-end checkpoints (``RoundCheckpoint``, the CLI's default, ``every_n_epochs`` at the epoch's end) are not, and at
lag 0 the same callbacks stay accepted, as Lightning accepts them.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import yaml
from conftest import TINY, quiet_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from test_async_rollouts import lagged
from test_bad_inputs import BASE, error_lines

from grpo_lightning import GRPOModule, RolloutDataModule
from grpo_lightning.callbacks import RoundCheckpoint
from grpo_lightning.cli import main
from grpo_lightning.config import ConfigError, EvalConfig, ScheduleConfig, UpdateConfig


class _FirstRound(Exception):
    """Raised where the first round would be drawn: every check before training has passed."""


@pytest.fixture
def no_rounds(monkeypatch):
    """No round is drawn (at a lag, no background process starts): reaching one raises ``_FirstRound``."""

    def first_round(self):
        raise _FirstRound

    monkeypatch.setattr(RolloutDataModule, "collect_round", first_round)


def fit_once(root, lag: int, checkpoint, **trainer_settings) -> None:
    """``fit`` a tiny model at ``lag`` with ``checkpoint``, two micro-batches a round (validation on when
    ``limit_val_batches`` says so)."""
    validates = trainer_settings.get("limit_val_batches", 0) != 0
    held_out = {"val_split": "test", "eval": EvalConfig(limit=2)} if validates else {}
    data = lagged(schedule=ScheduleConfig(rollout_lag=lag), update=UpdateConfig(mini_batch_size=2), **held_out)
    trainer = quiet_trainer(root, max_epochs=2, enable_checkpointing=True, callbacks=[checkpoint], **trainer_settings)
    trainer.fit(GRPOModule(tiny_model=TINY), datamodule=data)


INSIDE_A_ROUND = {
    "every_n_train_steps": (
        lambda: ModelCheckpoint(every_n_train_steps=1),
        {},
        r"^trainer.callbacks: ModelCheckpoint\(every_n_train_steps=1\) saves inside a round, which a run at "
        r"data.schedule.rollout_lag=1 cannot resume from .*; save at round ends: "
        r"grpo_lightning.callbacks.RoundCheckpoint",
    ),
    "train_time_interval": (
        lambda: ModelCheckpoint(train_time_interval=timedelta(minutes=30)),
        {},
        r"^trainer.callbacks: ModelCheckpoint\(train_time_interval=0:30:00\) saves inside a round",
    ),
    "after_a_validation_inside_a_round": (
        lambda: ModelCheckpoint(),
        {"limit_val_batches": 1, "check_val_every_n_epoch": 1, "val_check_interval": 0.5},
        r"^trainer.callbacks: ModelCheckpoint \(after each validation, trainer.val_check_interval=0.5\) saves inside "
        r"a round, .*; give it save_on_train_epoch_end: true",
    ),
    "after_a_validation_by_time": (
        lambda: ModelCheckpoint(),
        {"limit_val_batches": 1, "val_check_interval": "00:00:10:00"},
        r"\(after each validation, trainer.val_check_interval=every 600 s\) saves inside a round",
    ),
}


@pytest.mark.parametrize("name", sorted(INSIDE_A_ROUND))
def test_a_lagged_run_refuses_a_checkpoint_inside_a_round_before_any_round(tmp_path, no_rounds, name):
    make, settings, message = INSIDE_A_ROUND[name]
    with pytest.raises(ConfigError, match=message) as refused:
        fit_once(tmp_path, 1, make(), **settings)
    assert "\n" not in str(refused.value)


ACCEPTED = {
    "lag_0_every_n_train_steps": (0, lambda: ModelCheckpoint(every_n_train_steps=1), {}),
    "lag_0_after_a_validation_inside_a_round": (
        0,
        lambda: ModelCheckpoint(),
        {"limit_val_batches": 1, "check_val_every_n_epoch": 1, "val_check_interval": 0.5},
    ),
    "lag_1_round_checkpoint": (1, lambda: RoundCheckpoint(every_n_rounds=1), {}),
    "lag_1_every_n_epochs": (1, lambda: ModelCheckpoint(every_n_epochs=1, save_on_train_epoch_end=True), {}),
    "lag_1_validation_inside_a_round_saved_at_round_ends": (
        1,
        lambda: ModelCheckpoint(save_on_train_epoch_end=True),
        {"limit_val_batches": 1, "check_val_every_n_epoch": 1, "val_check_interval": 0.5},
    ),
    "lag_1_validation_every_round_length_in_batches": (
        1,
        lambda: ModelCheckpoint(),
        {"limit_val_batches": 1, "check_val_every_n_epoch": None, "val_check_interval": 2},  # 2 batches a round
    ),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_round_end_checkpoints_and_any_at_lag_0_reach_the_first_round(tmp_path, no_rounds, name):
    lag, make, settings = ACCEPTED[name]
    with pytest.raises(_FirstRound):
        fit_once(tmp_path, lag, make(), **settings)


# ---------------------------------------------------------------------------------------------- the CLI
STEPS = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"every_n_train_steps": 2}}


def cli_config(tmp_path, callbacks: list | None) -> str:
    """``test_bad_inputs``' small config with checkpointing on: ``callbacks``, or the CLI's default when None."""
    config = json.loads(json.dumps(BASE))
    del config["trainer"]["enable_checkpointing"]
    if callbacks is not None:
        config["trainer"]["callbacks"] = callbacks
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    return str(tmp_path / "config.yaml")


def test_the_cli_refuses_every_n_train_steps_at_a_lag_in_one_line(tmp_path, monkeypatch, capsys, no_rounds):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", cli_config(tmp_path, [STEPS]), "--data.schedule.rollout_lag", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    lines = error_lines(err)
    assert len(lines) == 1, err[-2000:]
    assert lines[0].startswith("error: trainer.callbacks: ModelCheckpoint(every_n_train_steps=2) saves inside a round")
    assert "data.schedule.rollout_lag=1" in lines[0] and "RoundCheckpoint(every_n_rounds=N)" in lines[0]


@pytest.mark.parametrize(
    "callbacks,lag",
    [([STEPS], "0"), (None, "1")],
    ids=["every_n_train_steps_at_lag_0", "the_default_round_checkpoint_at_lag_1"],
)
def test_the_cli_accepts_the_same_callback_at_lag_0_and_its_default_at_a_lag(
    tmp_path, monkeypatch, no_rounds, callbacks, lag
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(_FirstRound):
        main(["fit", "--config", cli_config(tmp_path, callbacks), "--data.schedule.rollout_lag", lag])
