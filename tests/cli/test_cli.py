"""The command line end to end: fit → checkpoint → validate, and config composition.

Bad input refused early: tests/cli/test_bad_inputs.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]

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
        "lr": 1e-3,
    },
    "data": {
        "sampling": {"group_size": 4, "max_new_tokens": 4},
        "prompts_per_round": 4,
        "eval": {"limit": 16},
        "task_kwargs": {"test_size": 50},
    },
}


def run_cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": os.pathsep.join([str(ROOT), str(cwd)]), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "grpo_lightning", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow  # a minute: the slow tier (`pytest -m slow`, .ci/run)
def test_fit_three_rounds_then_validate_the_checkpoint_then_resume_two_more(tmp_path):
    config = json.loads(json.dumps(TINY_CONFIG))
    config["trainer"]["enable_checkpointing"] = True
    config["trainer"]["callbacks"] = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            # every round kept: epoch=<round - 1>-step=<optimizer steps so far>.ckpt (one step per round here)
            "init_args": {
                "dirpath": str(tmp_path / "ckpt"),
                "save_last": True,
                "save_top_k": -1,
                "every_n_epochs": 1,
                "save_on_train_epoch_end": True,
            },
        }
    ]
    # A reward with spread among a random model's completions (exact_answer is 0 for all of them): without one
    # every advantage is 0, the policy does not move, and "the resumed run trained" could not be told.
    (tmp_path / "cli_rewards.py").write_text(
        "def char_sum(prompts, completions, **_):\n    return [float(sum(map(ord, c)) % 5) for c in completions]\n"
    )
    config["data"]["rewards"] = [{"name": "cli_rewards.char_sum"}]
    cfg = write_config(tmp_path / "c.yaml", config)
    fit = run_cli("fit", "--config", str(cfg), cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-3000:]
    last = tmp_path / "ckpt" / "last.ckpt"
    rounds = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "ckpt").glob("epoch=*.ckpt")}
    assert sorted(rounds) == ["epoch=0-step=1.ckpt", "epoch=1-step=2.ckpt", "epoch=2-step=3.ckpt"]
    before = torch.load(last, weights_only=False, map_location="cpu")
    assert (before["epoch"], before["global_step"]) == (2, 3)
    val = run_cli("validate", "--config", str(cfg), "--ckpt_path", str(last), cwd=tmp_path)
    assert val.returncode == 0, val.stderr[-3000:]
    assert "val/accuracy" in val.stdout

    # Resume: --ckpt_path continues where the checkpoint stopped, two more rounds up to max_epochs=5.
    resumed = run_cli("fit", "--config", str(cfg), "--trainer.max_epochs", "5", "--ckpt_path", str(last), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = torch.load(last, weights_only=False, map_location="cpu")
    assert (after["epoch"], after["global_step"]) == (4, 5)  # 3 + 2 optimizer steps, not 5 from a fresh start
    now = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "ckpt").glob("epoch=*.ckpt")}
    assert sorted(set(now) - set(rounds)) == ["epoch=3-step=4.ckpt", "epoch=4-step=5.ckpt"]
    assert {name: now[name] for name in rounds} == rounds  # rounds 1-3 were not run (nor saved) again
    policy = [k for k in before["state_dict"] if k.startswith("policy.")]
    assert policy and any(not torch.equal(before["state_dict"][k], after["state_dict"][k]) for k in policy)


def test_print_config_and_composition(tmp_path):
    base = write_config(tmp_path / "base.yaml", TINY_CONFIG)
    override = write_config(tmp_path / "override.yaml", {"model": {"objective": {"beta": 0.0, "loss_type": "dapo"}}})
    out = run_cli(
        "fit",
        "--config",
        str(base),
        "--config",
        str(override),
        "--data.sampling.group_size",
        "6",
        "--print_config",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    printed = yaml.safe_load(out.stdout)
    assert printed["model"]["objective"]["beta"] == 0.0
    assert printed["model"]["objective"]["loss_type"] == "dapo"
    assert printed["data"]["sampling"]["group_size"] == 6
    assert printed["data"]["sampling"]["max_new_tokens"] == 4  # from the base file
    assert printed["trainer"]["reload_dataloaders_every_n_epochs"] == 1
