"""Vision-language GRPO end to end (issue 42): two rounds of ``fit`` on a tiny Qwen2-VL, prompts that show coloured
squares to count (images drawn in code, saved as files a jsonl names) beside a text-only row, on the transformers
engine; π_old and π_ref log-prob passes with each row's images; the vision tower frozen."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import quiet_trainer
from vision_models import COLOURS, image_prompt, squares

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig, UpdateConfig
from grpo_lightning.config import ConfigError
from grpo_lightning.integrations.agents import AgentEnvironment
from grpo_lightning.integrations.vision.inputs import packing_off
from grpo_lightning.integrations.vision.models import vision_tower_pattern, vision_towers
from grpo_lightning.integrations.vision.tiny import build_tiny_vlm
from grpo_lightning.lora import LoraConfig
from grpo_lightning.rewards import RewardSpec, register


@register("test_vision_count")
def count_reward(prompts, completions, answer, **_):
    """1 when the completion's first number is the count of squares (conversational completions: the message's),
    plus a little for its characters (their code points mod 5, / 10): spread even for a random model."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    right = [(m := re.search(r"\d+", t)) is not None and m.group() == str(a) for t, a in zip(texts, answer)]
    return [float(r) + sum(map(ord, t)) % 5 / 10 for r, t in zip(right, texts)]


def count_file(folder, rows: int = 6) -> str:
    """A jsonl of counting prompts (1 to 4 squares, one image each, a path) and one text-only row."""
    lines = []
    for i in range(rows - 1):
        path = folder / f"squares_{i}.png"
        squares(i % 4 + 1, COLOURS[i % 4]).save(path)
        lines.append({"prompt": image_prompt("How many squares?", 1), "images": [str(path)], "answer": i % 4 + 1})
    lines.append({"prompt": [{"role": "user", "content": "Say 2."}], "images": [], "answer": 2})
    file = folder / "count.jsonl"
    file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(file)


def vision_run(tmp_path, family="qwen2_vl", **data_settings):
    """A tiny ``family`` model (built in ``tmp_path / family``) and the counting data: 3 prompts × G = 2 a round,
    two optimizer steps; ``data_settings`` override the data's."""
    model = str(build_tiny_vlm(family, tmp_path / family))
    module = GRPOModule(model_name_or_path=model, objective=ObjectiveConfig(beta=0.04), lr=1e-2)
    settings = {
        "dataset": count_file(tmp_path),
        "engine": "transformers",
        "rewards": [RewardSpec("test_vision_count")],
        "sampling": SamplingConfig(group_size=2, max_new_tokens=4, temperature=1.0),
        "prompts_per_round": 3,
        "update": UpdateConfig(mini_batch_size=3, micro_batch_size=3),  # two optimizer steps a round: π_old recorded
        **data_settings,
    }
    return module, RolloutDataModule(**settings)


def test_two_rounds_train_the_language_model_on_images_with_the_vision_tower_frozen(tmp_path):
    module, data = vision_run(tmp_path)
    module.configure_model()
    tower = {name: p.detach().clone() for name, p in vision_towers(module.policy)[0].named_parameters()}
    head = module.policy.lm_head.weight.detach().clone()
    assert not any(p.requires_grad for p in vision_towers(module.policy)[0].parameters())
    trainer = quiet_trainer(tmp_path, max_epochs=2)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 4  # 2 rounds x 2 optimizer steps
    rollout = data.last_rollout
    assert len(rollout.vision) == len(rollout) == 6
    assert rollout.old_logprobs is not None and rollout.ref_logprobs is not None
    # Each image row's inputs are its own prompt's: image rows carry pixels and a grid, the text-only row none.
    image_rows = [i for i, p in enumerate(rollout.prompts) if isinstance(p[0]["content"], list)]
    assert all("image_grid_thw" in rollout.vision[i] for i in image_rows)
    assert all(rollout.vision[i] == {} for i in range(len(rollout)) if i not in image_rows)
    image_token = module.policy.config.image_token_id
    assert all(bool((rollout.prompt_ids[i] == image_token).any()) for i in image_rows)
    assert not torch.equal(module.policy.lm_head.weight, head)  # the language model trained
    for name, p in vision_towers(module.policy)[0].named_parameters():
        torch.testing.assert_close(p, tower[name], rtol=0, atol=0)  # the vision tower did not


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"engine": "lean"}, "data.engine: lean .* set data.engine: transformers"),
        (
            {"environment": AgentEnvironment(command="true")},
            "data.environment: an AgentEnvironment's agents .* never see a vision-language model's images",
        ),
    ],
)
def test_what_a_vision_language_model_cannot_use_yet_is_refused_before_training(tmp_path, settings, match):
    module, data = vision_run(tmp_path, **settings)
    trainer = quiet_trainer(tmp_path, max_epochs=1)
    with pytest.raises(ConfigError, match=match):
        trainer.fit(module, datamodule=data)
    assert trainer.global_step == 0 and data.train_data is None  # before the data was even checked


def test_the_cli_trains_and_evaluates_a_vision_language_model(tmp_path, caplog):
    """``grpo_lightning fit`` on a config that names the folder: two rounds, then held-out evaluation with images
    (``data.val_fraction``); ``data.update.pack_tokens: auto`` is turned off for the image rows, in one line."""
    import yaml

    from grpo_lightning.cli import GRPOCLI

    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu", "max_epochs": 2, "logger": False, "enable_checkpointing": False,
            "check_val_every_n_epoch": 2, "enable_progress_bar": False,
        },
        "model": {
            "model_name_or_path": str(build_tiny_vlm("qwen2_vl", tmp_path / "qwen2_vl")),
            "freeze_vision_tower": True,
            "objective": {"beta": 0.0},
        },
        "data": {
            "dataset": count_file(tmp_path, rows=9),
            "val_fraction": 0.34,
            "engine": "transformers",
            "rewards": [{"name": "test_vision_count"}],
            "sampling": {"group_size": 2, "max_new_tokens": 3},
            "prompts_per_round": 2,
            "update": {"pack_tokens": "auto"},
        },
    }  # fmt: skip
    path = tmp_path / "vision.yaml"
    path.write_text(yaml.safe_dump(config))
    packing_off.cache_clear()  # said once per process: an earlier run here may have said it
    with caplog.at_level("WARNING"):
        cli = GRPOCLI(args=["fit", "--config", str(path), "--trainer.default_root_dir", str(tmp_path)])
    assert cli.trainer.global_step == 2 and "val/accuracy" in cli.trainer.callback_metrics
    assert len(cli.datamodule.val_data) == 3 and len(cli.datamodule.last_rollout.vision) == 4
    notices = [r.getMessage() for r in caplog.records if "pack_tokens" in r.getMessage()]
    assert notices == ["data.update.pack_tokens: auto is off for a vision-language model: its rows run padded"]


def test_a_round_with_lora_on_the_language_model(tmp_path):
    """``model.lora`` on a vision-language model: adapters on the language model only, π_ref the policy with its
    adapter disabled (given the same images), the adapters trained."""
    module, data = vision_run(tmp_path)
    module.lora = LoraConfig(r=4, alpha=8)
    module.configure_model()
    adapters = {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    assert not any(re.fullmatch(vision_tower_pattern(), n) for n in adapters)
    trainer = quiet_trainer(tmp_path, max_epochs=1)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 2 and data.last_rollout.ref_logprobs is not None
    moved = [n for n, p in module.policy.named_parameters() if n in adapters and not torch.equal(p, adapters[n])]
    assert moved
