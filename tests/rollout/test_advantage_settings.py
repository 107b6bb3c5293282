"""``data.advantage``'s pass@k estimator and GDPO aggregation in the round: the rewards' weights reach GDPO's sum,
a run trains with either, and what cannot work is refused when the DataModule is built, before training."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import TINY, quiet_trainer
from helpers import attach, checksum_reward, length_reward, step_length_reward

from grpo_lightning import GRPOModule, RolloutDataModule, SamplingConfig
from grpo_lightning.advantages import batch_normalized, decoupled_sum, passk_advantages
from grpo_lightning.config import AdvantageConfig, ConfigError, EvalConfig
from grpo_lightning.rewards import RewardSpec, register
from grpo_lightning.rollout.round import compute_advantages

register("test_estimators_length")(length_reward)
register("test_estimators_checksum")(checksum_reward)
register("test_estimators_steps")(step_length_reward)

TWO_REWARDS = [RewardSpec("test_estimators_length", weight=0.5), RewardSpec("test_estimators_checksum", weight=2.0)]
GDPO = AdvantageConfig(multi_objective_aggregation="normalize_then_sum")
PASSK = AdvantageConfig(estimator="passk", k=3, std="sample")


def data_module(advantage: AdvantageConfig, **settings) -> RolloutDataModule:
    settings = {"rewards": TWO_REWARDS, "sampling": SamplingConfig(group_size=4, max_new_tokens=4), **settings}
    return RolloutDataModule(advantage=advantage, prompts_per_round=2, eval=EvalConfig(limit=4), **settings)


def test_the_rewards_weights_reach_gdpo(tmp_path):
    module, data = GRPOModule(tiny_model=TINY), data_module(GDPO)
    attach(module, data, quiet_trainer(tmp_path))
    module.configure_model()
    settings = data.collector.round_settings()
    weights = data.collector.scorer(["1+1="], ["2"], {}).weights  # each column's, beside its values on the batch
    assert weights == {"test_estimators_length": 0.5, "test_estimators_checksum": 2.0}
    columns = {"test_estimators_length": [1.0, 3.0, 2.0, 2.0], "test_estimators_checksum": [0.0, 1.0, 4.0, 1.0]}
    batch = SimpleNamespace(
        rewards=torch.zeros(4), reward_columns=columns, reward_weights=weights, unscorable=None, step_rewards=None
    )
    rewards = torch.tensor([columns["test_estimators_length"], columns["test_estimators_checksum"]]).T
    weighted = batch_normalized(decoupled_sum(rewards, torch.tensor([0.5, 2.0]), 4))
    assert torch.equal(compute_advantages(batch, settings), weighted)
    unweighted = batch_normalized(decoupled_sum(rewards, torch.ones(2), 4))
    assert not torch.allclose(weighted, unweighted, atol=1e-2)  # the weights matter here


@pytest.mark.parametrize("advantage", [GDPO, PASSK], ids=["gdpo", "passk"])
def test_a_run_trains_with_it(tmp_path, advantage):
    """The round's advantages are the estimator's, on the rollout's own rewards."""
    module, data = GRPOModule(tiny_model=TINY, lr=1e-3), data_module(advantage)
    quiet_trainer(tmp_path, max_epochs=1).fit(module, datamodule=data)
    rollout = data.last_rollout
    if advantage.estimator == "passk":
        expected = passk_advantages(rollout.rewards, 4, k=3, std="sample", scorable=~rollout.unscorable)
    else:
        names = list(rollout.reward_columns)
        rewards = torch.tensor([rollout.reward_columns[name] for name in names]).T
        expected = batch_normalized(decoupled_sum(rewards, torch.tensor([0.5, 2.0]), 4))
    assert torch.equal(rollout.advantages, expected)
    assert rollout.advantages.abs().max() > 0  # the tiny model's completions differ in length: there was signal


@pytest.mark.parametrize(
    "advantage,rewards,message",
    [
        (
            AdvantageConfig(estimator="passk", k=5),
            TWO_REWARDS,
            r"data.advantage.k must be at most data.sampling.group_size=4 \(got 5\)",
        ),
        (
            GDPO,
            [RewardSpec("test_estimators_length"), RewardSpec("test_estimators_steps")],
            "data.advantage.multi_objective_aggregation: normalize_then_sum takes outcome rewards only",
        ),
        (PASSK, [RewardSpec("test_estimators_steps")], "data.advantage.estimator: passk takes outcome rewards only"),
    ],
    ids=["k_above_group_size", "gdpo_with_process_rewards", "passk_with_process_rewards"],
)
def test_refused_before_training(advantage, rewards, message):
    with pytest.raises(ConfigError, match=message) as error:
        data_module(advantage, rewards=rewards)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"scale": "batch"}, r"leave baseline: mean and scale: group \(got mean, batch\)"),
        ({"scale": "none"}, r"leave baseline: mean and scale: group \(got mean, none\)"),
        ({"baseline": "rloo"}, r"leave baseline: mean and scale: group \(got rloo, group\)"),
        ({"estimator": "passk"}, "normalize_then_sum does not combine with estimator: passk"),
    ],
)
def test_gdpo_refuses_what_it_fixes_itself(settings, message):
    with pytest.raises(ConfigError, match=message) as error:
        AdvantageConfig(multi_objective_aggregation="normalize_then_sum", **settings)
    assert "\n" not in str(error.value)


def test_an_unknown_aggregation_is_refused():
    with pytest.raises(ConfigError, match="multi_objective_aggregation must be sum_then_normalize or normalize_then"):
        AdvantageConfig(multi_objective_aggregation="sum")


def test_settings_pickled_before_the_new_fields_get_their_defaults():
    old = AdvantageConfig.__new__(AdvantageConfig)
    old.__setstate__({"baseline": "rloo", "scale": "group", "std": "sample", "eps": 1e-4})
    assert (old.estimator, old.k, old.multi_objective_aggregation) == ("grpo", None, "sum_then_normalize")
    assert old.baseline == "rloo"
