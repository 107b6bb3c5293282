"""The GRPO family wired end to end: dynamic sampling, process rewards, KL control, reference sync, recipes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY, quiet_trainer

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.callbacks.kl import KLController, ReferenceSync, adaptive_beta
from grpo_lightning.cli import GRPOCLI
from grpo_lightning.loss import process_advantages
from grpo_lightning.models.tiny import build_char_tokenizer
from grpo_lightning.rewards import RewardSpec, register
from grpo_lightning.rollout.steps import step_token_ends

ROOT = Path(__file__).resolve().parents[1]


@register("test_even_a_length")
def even_a_length(prompts, completions, **_):
    """Informative only for prompts whose first operand is even: other groups all score 0."""
    return [float(len(c)) if int(p.split("+")[0]) % 2 == 0 else 0.0 for p, c in zip(prompts, completions)]


def process_reward(prompts, completions, **_):
    """One reward per step (steps separated by '1'): the step's length."""
    return [[float(len(step)) for step in c.split("1")] for c in completions]


process_reward.process = True
process_reward.step_separator = "1"
register("test_process")(process_reward)


def fit(module, data, epochs=1, callbacks=(), tmp_path=None):
    trainer = quiet_trainer(
        tmp_path,
        max_epochs=epochs,
        callbacks=list(callbacks),
    )
    trainer.fit(module, datamodule=data)
    return trainer


def tiny_module(rewards, **objective):
    return GRPOModule(
        tiny_model=TINY,
        rewards=[RewardSpec(r) for r in rewards],
        sampling=SamplingConfig(group_size=4, max_new_tokens=6),
        objective=ObjectiveConfig(**objective),
        lr=1e-3,
    )


def test_dynamic_sampling_keeps_only_informative_groups(tmp_path):
    module = tiny_module(["test_even_a_length"], beta=0.0)
    data = RolloutDataModule(prompts_per_round=4, dynamic_sampling=True, max_sampling_rounds=8, val_split=None)
    fit(module, data, tmp_path=tmp_path)
    rollout = data.last_rollout
    assert len(rollout) == 16
    firsts = {int(p.split("+")[0]) % 2 for p in rollout.prompts}
    assert firsts == {0}  # every kept group is informative
    assert rollout.metrics["rollout/filtered_fraction"] == 0.0
    assert rollout.metrics["rollout/sampling_rounds"] >= 2  # about half the prompts were dropped
    assert data.position == 4 * rollout.metrics["rollout/sampling_rounds"]  # every drawn prompt is counted


def test_dynamic_sampling_cap_tops_up_with_uninformative_groups(tmp_path):
    module = tiny_module(["test_even_a_length"], beta=0.0)
    data = RolloutDataModule(prompts_per_round=8, dynamic_sampling=True, max_sampling_rounds=1, val_split=None)
    fit(module, data, tmp_path=tmp_path)
    assert len(data.last_rollout) == 32  # the size never changes (ranks stay in step)
    assert data.last_rollout.metrics["rollout/sampling_rounds"] == 1


def test_step_token_ends_on_a_hand_example():
    tok = build_char_tokenizer()
    texts = ["ab1cd1e", "xy"]
    enc = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    ids = torch.full((2, 8), tok.pad_token_id)
    mask = torch.zeros((2, 8), dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, : len(e)] = torch.tensor(e)
        mask[i, : len(e)] = 1
    ends = step_token_ends(texts, ids, mask, tok, "1")
    # "ab|1cd|1e<eos>": step "ab" ends at token 1, "cd" at token 4, "e" at the last token (EOS, index 7)
    assert ends.tolist() == [[1, 4, 7], [2, -1, -1]]


def test_process_rewards_give_per_token_advantages(tmp_path):
    module = tiny_module(["test_process"], beta=0.0)
    data = RolloutDataModule(prompts_per_round=2, val_split=None)
    fit(module, data, tmp_path=tmp_path)
    rollout = data.last_rollout
    assert rollout.advantages.shape == rollout.completion_ids.shape
    expected = process_advantages(rollout.step_rewards, rollout.step_ends, rollout.completion_mask, 4)
    torch.testing.assert_close(rollout.advantages, expected)
    lengths = [[len(s) for s in c.split("1")] for c in rollout.completions]
    for row, values in enumerate(lengths):
        assert rollout.step_rewards[row, : len(values)].tolist() == [float(v) for v in values]


def test_adaptive_beta_formula():
    # KL above target by 50%: error clipped to +0.2; n / horizon = 100 / 1000
    assert adaptive_beta(0.1, kl=0.15, target=0.1, num_samples=100, horizon=1000) == pytest.approx(0.1 * 1.02)
    # KL at half the target: error −0.5 clipped to −0.2
    assert adaptive_beta(0.1, kl=0.05, target=0.1, num_samples=100, horizon=1000) == pytest.approx(0.1 * 0.98)
    assert adaptive_beta(0.1, kl=0.11, target=0.1, num_samples=1000, horizon=1000) == pytest.approx(0.1 * 1.1)


def test_kl_controller_lowers_beta_when_kl_is_below_target(tmp_path):
    module = tiny_module(["test_even_a_length"], beta=0.1)
    controller = KLController(target_kl=10.0, horizon=100)  # KL of a tiny run is far below 10
    fit(
        module,
        RolloutDataModule(prompts_per_round=2, val_split=None),
        epochs=2,
        callbacks=[controller],
        tmp_path=tmp_path,
    )
    assert module.objective.beta == pytest.approx(0.1 * (1 - 0.2 * 8 / 100) ** 2)
    assert controller.state_dict() == {"beta": module.objective.beta}


def test_reference_sync_moves_reference_towards_policy(tmp_path):
    module = tiny_module(["test_even_a_length"], beta=0.1)
    module.configure_model()
    ref_before = [p.clone() for p in module.ref.parameters()]
    sync = ReferenceSync(sync_steps=1, alpha=0.5)
    trainer = fit(
        module, RolloutDataModule(prompts_per_round=2, val_split=None), epochs=1, callbacks=[sync], tmp_path=tmp_path
    )
    assert trainer.global_step == 1
    for before, ref, policy in zip(ref_before, module.ref.parameters(), module.policy.parameters()):
        torch.testing.assert_close(ref, 0.5 * before + 0.5 * policy.detach())
    assert module.ref_changes  # so checkpoints now keep the reference


@pytest.mark.parametrize("recipe", ["grpo", "dapo", "dr_grpo", "gspo"])
def test_recipe_configs_compose_with_the_quickstart(recipe, monkeypatch):
    monkeypatch.chdir(ROOT)
    cli = GRPOCLI(
        args=[
            "--config",
            "configs/quickstart.yaml",
            "--config",
            f"configs/recipes/{recipe}.yaml",
            "--trainer.logger",
            "false",
            "--trainer.callbacks",
            "[]",
        ],
        run=False,
    )
    assert (
        cli.model.objective.loss_type == {"grpo": "grpo", "dapo": "dapo", "dr_grpo": "dr_grpo", "gspo": "grpo"}[recipe]
    )
    if recipe == "gspo":
        assert cli.model.objective.importance_sampling_level == "sequence"
    if recipe == "dapo":
        assert cli.datamodule.dynamic_sampling and cli.model.objective.epsilon_high == 0.28
