"""What a user gets without asking: a checkpoint, a readable log file, the derived gradient accumulation.

- A config without a checkpoint callback still leaves ``last.ckpt`` (and ``--ckpt_path last`` resumes it exactly);
  ``trainer.enable_checkpointing: false`` is respected.
- Output sent to a file gets one plain line per round (``RoundLog``), no progress bar.
- ``trainer.accumulate_grad_batches`` follows from ``data.update.mini_batch_size / data.update.micro_batch_size``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, quiet_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from test_cli import TINY_CONFIG, write_config

from grpo_lightning import GRPOModule, RolloutDataModule, SamplingConfig
from grpo_lightning.callbacks import RoundCheckpoint, RoundLog
from grpo_lightning.callbacks.checkpointing import default_checkpoint
from grpo_lightning.cli import GRPOCLI, main
from grpo_lightning.config import ConfigError, UpdateConfig

ROOT = Path(__file__).resolve().parents[2]
ROUND_LINE = re.compile(
    r"^round (\d+)/(\d+) \| reward -?[\d.]+ \| (accuracy [\d.]+% \| )?\d+ gen tok/s \| [\d.]+ s/round \| ETA "
)


def policy_weights(path: Path) -> dict[str, torch.Tensor]:
    state = torch.load(path, weights_only=False, map_location="cpu")["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("policy.")}


def test_a_config_without_a_checkpoint_callback_leaves_last_ckpt_which_resumes_exactly(
    tmp_path, monkeypatch, capsys, caplog
):
    """In process (``cli.main``, as ``python -m grpo_lightning`` runs it): 2 rounds, and 1 + 1 resumed with
    ``--ckpt_path last``, end with the same weights bit for bit."""
    config = json.loads(json.dumps(TINY_CONFIG))
    config["trainer"].pop("enable_checkpointing", None)
    config["trainer"]["check_val_every_n_epoch"] = 100  # validated only at the end: Lightning's default saved nothing
    (tmp_path / "path_rewards.py").write_text(
        "def char_sum(prompts, completions, **_):\n    return [float(sum(map(ord, c)) % 5) for c in completions]\n"
    )
    config["data"]["rewards"] = [{"name": "path_rewards.char_sum"}]
    cfg = str(write_config(tmp_path / "c.yaml", config))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")

    def fit(rounds: int, root: str, *extra: str) -> str:
        main(["fit", "--config", cfg, "--trainer.max_epochs", str(rounds), "--trainer.default_root_dir", root, *extra])
        captured = capsys.readouterr()
        return captured.out + captured.err

    with caplog.at_level(logging.INFO):
        fit(2, "whole")
    assert "no checkpoint callback in the config: saving" in caplog.text
    assert sorted(p.name for p in (tmp_path / "whole" / "checkpoints").iterdir()) == ["last.ckpt"]
    fit(1, "split")
    last = tmp_path / "split" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False, map_location="cpu")["global_step"] == 1  # at the end
    output = fit(2, "split", "--ckpt_path", "last")
    expected, got = policy_weights(tmp_path / "whole" / "checkpoints" / "last.ckpt"), policy_weights(last)
    assert expected.keys() == got.keys() and expected
    assert all(torch.equal(expected[k], got[k]) for k in expected), "1 + 1 resumed rounds differ from 2"
    # The captured output is not a terminal: one plain line per round, no progress bar.
    lines = [line for line in output.splitlines() if line.startswith("round ")]
    assert [ROUND_LINE.match(line).group(1, 2) for line in lines] == [("2", "2")], output[-2000:]


def test_the_default_checkpoint_respects_the_config():
    root = {"default_root_dir": "runs/x"}
    made = default_checkpoint(root, [], rounds=True)
    assert isinstance(made, RoundCheckpoint) and made.save_last and made.save_top_k == 0
    assert made.dirpath == os.path.abspath(os.path.join("runs/x", "checkpoints"))
    assert default_checkpoint({**root, "enable_checkpointing": False}, [], rounds=True) is None
    assert default_checkpoint(root, [ModelCheckpoint()], rounds=True) is None  # the config's own wins
    sft = default_checkpoint(root, [], rounds=False)
    assert type(sft) is ModelCheckpoint and sft.save_last and sft._save_on_train_epoch_end


def test_the_quickstart_to_a_log_file_reads_one_line_per_round(tmp_path):
    """``python -m grpo_lightning fit --config configs/quickstart.yaml > run.log 2>&1``, two rounds."""
    log_file = tmp_path / "run.log"
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "grpo_lightning", "fit", "--config", "configs/quickstart.yaml",
               "--trainer.max_epochs", "2", "--trainer.default_root_dir", str(tmp_path / "run")]  # fmt: skip
    with log_file.open("w") as out:
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=300)
    text = log_file.read_text()
    assert done.returncode == 0, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("round ")]
    assert len(lines) == 2 and all(ROUND_LINE.match(line) for line in lines), text[-3000:]
    assert "\r" not in text.split("round 1/2")[1]  # no progress bar redrawing itself in the file
    assert "LightningCLI's args parameter" not in text


def test_round_log_writes_to_its_stream_when_it_is_not_a_terminal(tmp_path):
    stream = io.StringIO()
    module = GRPOModule(tiny_model=TINY, lr=1e-3)
    data = RolloutDataModule(sampling=SamplingConfig(group_size=4, max_new_tokens=4), prompts_per_round=4)
    trainer = quiet_trainer(tmp_path, max_epochs=2, callbacks=[RoundLog(stream=stream)])
    trainer.fit(module, datamodule=data)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("round 1/2 | reward ") and "ETA 0:00:00" in lines[1]
    with pytest.raises(ValueError, match="RoundLog.when"):
        RoundLog(when="sometimes")


def test_gradient_accumulation_follows_from_mini_and_micro_batch_sizes(tmp_path):
    def data(**kwargs):
        return RolloutDataModule(
            sampling=SamplingConfig(group_size=4, max_new_tokens=4), prompts_per_round=4, val_split=None, **kwargs
        )

    args = ["--data.update.mini_batch_size", "8", "--data.update.micro_batch_size", "2", "--trainer.max_epochs", "1"]
    cli = GRPOCLI(args=["--config", str(write_config(tmp_path / "c.yaml", TINY_CONFIG)), *args], run=False)
    assert cli.trainer.accumulate_grad_batches == 4  # the CLI derives it from the batch sizes
    unset = quiet_trainer(tmp_path, max_epochs=1)  # a Trainer built in Python is told, the data side sets nothing
    with pytest.raises(ConfigError, match=r"^trainer.accumulate_grad_batches = 1, but .* = 4 micro-batches"):
        unset.fit(
            GRPOModule(tiny_model=TINY, lr=1e-3),
            datamodule=data(update=UpdateConfig(mini_batch_size=8, micro_batch_size=2)),
        )
    agreeing = quiet_trainer(tmp_path, max_epochs=1, accumulate_grad_batches=4)
    agreeing.fit(
        GRPOModule(tiny_model=TINY, lr=1e-3),
        datamodule=data(update=UpdateConfig(mini_batch_size=8, micro_batch_size=2)),
    )
    assert agreeing.global_step == 2  # 16 completions, 2 optimizer steps of 4 micro-batches
    contradicting = quiet_trainer(tmp_path, max_epochs=1, accumulate_grad_batches=3)
    with pytest.raises(ConfigError, match=r"^trainer.accumulate_grad_batches = 3 contradicts .* = 4: leave it unset"):
        contradicting.fit(
            GRPOModule(tiny_model=TINY, lr=1e-3),
            datamodule=data(update=UpdateConfig(mini_batch_size=8, micro_batch_size=2)),
        )
