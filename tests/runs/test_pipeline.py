"""The pipeline's configs: each parses, and stage 4 mixes a rule-based and a model-based reward with YAML weights."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from conftest import TINY
from helpers import save_tiny_reward_model

from grpo_lightning.callbacks import SaveHFModel
from grpo_lightning.cli import GRPOCLI, SFTCLI
from grpo_lightning.rewards.model import clear_model_cache

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "configs" / "pipeline"
QUIET_TRAINER = {
    "logger": False,
    "callbacks": [],
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def test_the_pipeline_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(ROOT / "tools" / "run_pipeline.sh")]).returncode == 0


@pytest.mark.parametrize(
    "stage, cli_class",
    [("1_cold_start_sft", SFTCLI), ("2_reasoning_rl", GRPOCLI), ("3_rejection_sft", SFTCLI), ("4_mixed_rl", GRPOCLI)],
)
def test_every_stage_config_builds(stage, cli_class):
    # The stages' model folders exist only once the previous stage ran: a tiny model stands in for them here.
    args = ["--config", str(PIPELINE / f"{stage}.yaml"), "--model.model_name_or_path=null", "--trainer.logger=false"]
    cli = cli_class(args=args, run=False)
    assert cli.model.hparams.model_name_or_path is None
    assert any(isinstance(c, SaveHFModel) for c in cli.trainer.callbacks)  # each stage hands a folder on


@pytest.fixture
def tiny_reward_model(tmp_path):
    """A randomly initialised one-logit classifier over the character tokenizer, saved as a Hugging Face folder."""
    yield save_tiny_reward_model(tmp_path / "reward-model")
    clear_model_cache()


def test_second_rl_stage_combines_rule_and_model_rewards_with_yaml_weights(tmp_path, tiny_reward_model):
    stage = yaml.safe_load((PIPELINE / "4_mixed_rl.yaml").read_text())
    weights = {spec["name"]: spec["weight"] for spec in stage["data"]["rewards"]}
    assert set(weights) == {"exact_answer", "reward_model"}
    # The stage's own YAML, with a tiny policy, the tiny reward model and two short rounds instead of 20.
    override = {
        "trainer": {**QUIET_TRAINER, "max_epochs": 2, "check_val_every_n_epoch": 2},
        "model": {
            "model_name_or_path": None,
            "tiny_model": {
                k: getattr(TINY, k) for k in ("hidden_size", "num_layers", "num_heads", "intermediate_size")
            },
        },
        "data": {
            "rewards": [
                {**spec, "kwargs": {**spec.get("kwargs", {}), "model_name_or_path": tiny_reward_model}}
                if spec["name"] == "reward_model"
                else spec
                for spec in stage["data"]["rewards"]
            ],
            "prompts_per_round": 4,
            "update": {"mini_batch_size": 32},
            "eval": {"limit": 8},
            "task_kwargs": {"test_size": 50},
        },
    }
    path = tmp_path / "override.yaml"
    path.write_text(yaml.safe_dump(override))
    cli = GRPOCLI(args=["fit", "--config", str(PIPELINE / "4_mixed_rl.yaml"), "--config", str(path)])

    metrics = cli.trainer.callback_metrics
    assert "reward/exact_answer" in metrics and "reward/reward_model" in metrics  # both logged, by name
    assert "val/accuracy" in metrics
    assert "curriculum/preferred_fraction" in metrics  # the stage draws from the curriculum
    rollout = cli.datamodule.last_rollout
    exact, model = rollout.reward_columns["exact_answer"], rollout.reward_columns["reward_model"]
    assert all(0.0 < v < 1.0 for v in model)  # normalize: sigmoid, as the YAML says
    expected = torch.tensor([weights["exact_answer"] * e + weights["reward_model"] * m for e, m in zip(exact, model)])
    assert torch.allclose(rollout.rewards, expected, atol=1e-5)
