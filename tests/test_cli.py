"""The command line end to end: fit → checkpoint → validate, and config composition.

Bad input refused early: tests/test_bad_inputs.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

TINY_CONFIG = {
    "seed_everything": 0,
    "trainer": {
        "accelerator": "cpu",
        "max_epochs": 3,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "check_val_every_n_epoch": 3,
    },
    "model": {
        "tiny_model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64},
        "sampling": {"group_size": 4, "max_new_tokens": 4},
        "lr": 1e-3,
    },
    "data": {"prompts_per_round": 4, "val_limit": 16, "task_kwargs": {"test_size": 50}},
}


def run_cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "grpo_lightning", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def test_fit_three_rounds_then_validate_the_checkpoint(tmp_path):
    config = json.loads(json.dumps(TINY_CONFIG))
    config["trainer"]["enable_checkpointing"] = True
    config["trainer"]["callbacks"] = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True},
        }
    ]
    cfg = write_config(tmp_path / "c.yaml", config)
    fit = run_cli("fit", "--config", str(cfg), cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-3000:]
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.exists()
    val = run_cli("validate", "--config", str(cfg), "--ckpt_path", str(last), cwd=tmp_path)
    assert val.returncode == 0, val.stderr[-3000:]
    assert "val/accuracy" in val.stdout
    # resume: --ckpt_path continues training where the checkpoint stopped (3 more rounds up to max_epochs=6)
    resumed = run_cli("fit", "--config", str(cfg), "--trainer.max_epochs", "4", "--ckpt_path", str(last), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]


def test_print_config_and_composition(tmp_path):
    base = write_config(tmp_path / "base.yaml", TINY_CONFIG)
    override = write_config(tmp_path / "override.yaml", {"model": {"objective": {"beta": 0.0, "loss_type": "dapo"}}})
    out = run_cli(
        "fit",
        "--config",
        str(base),
        "--config",
        str(override),
        "--model.sampling.group_size",
        "6",
        "--print_config",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    printed = yaml.safe_load(out.stdout)
    assert printed["model"]["objective"]["beta"] == 0.0
    assert printed["model"]["objective"]["loss_type"] == "dapo"
    assert printed["model"]["sampling"]["group_size"] == 6
    assert printed["model"]["sampling"]["max_new_tokens"] == 4  # from the base file
    assert printed["trainer"]["reload_dataloaders_every_n_epochs"] == 1
