"""Advantage estimators behind a registry (issue 51): ``data.advantage.estimator`` and
``multi_objective_aggregation`` name registered entries, as ``model.objective.loss_type`` names a registered loss.

A user's estimator registered here trains a tiny round through the command line's config; an unknown name is
refused in one line naming the registered ones; every built-in gives, through ``compute_advantages``, exactly the
pure function's advantages (what the if/else chain before the registry called), on rewards with ties, None columns,
unscorable rows and a batch-wide std gathered from a second rank.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import TINY
from helpers import checksum_reward
from torch import Tensor

from grpo_lightning.advantage_registry import (
    AdvantageInputs,
    available_advantage_estimators,
    register_advantage_estimator,
)
from grpo_lightning.advantages import (
    batch_normalized,
    decoupled_sum,
    group_advantages,
    passk_advantages,
    process_advantages,
)
from grpo_lightning.cli import GRPOCLI, main
from grpo_lightning.config import AdvantageConfig, ConfigError, SamplingConfig
from grpo_lightning.rewards import register
from grpo_lightning.rollout.round import RoundSettings, compute_advantages, informative_groups

register("test_registry_checksum")(checksum_reward)  # spread even for a random model
CALLS: list[AdvantageInputs] = []


@register_advantage_estimator("test_registry_distance_to_best", source="a test")
def distance_to_best(inputs: AdvantageInputs) -> Tensor:
    """How far each completion is below its group's best: r_i - max(r), 0 for the best."""
    CALLS.append(inputs)
    groups = inputs.rewards.float().reshape(-1, inputs.group_size)
    return (groups - groups.amax(dim=1, keepdim=True)).reshape(-1)


# A tiny run through the command line (``tests/cli/test_bad_inputs.py``'s base): 4 prompts of G = 4, one round.
BASE = {
    "seed_everything": 0,
    "trainer": {
        "accelerator": "cpu",
        "max_epochs": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "limit_val_batches": 0,
    },
    "model": {"tiny_model": asdict(TINY), "lr": 1e-3},
    "data": {
        "sampling": {"group_size": 4, "max_new_tokens": 6},
        "rewards": [{"name": "test_registry_checksum"}],
        "prompts_per_round": 4,
        "eval": {"limit": 8},
        "task_kwargs": {"max_operand": 20, "test_size": 50},
    },
}


def write_config(tmp_path, **advantage) -> str:
    config = json.loads(json.dumps(BASE))
    config["data"]["advantage"] = advantage
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_a_registered_estimator_trains_a_round_through_the_config(tmp_path, monkeypatch):
    """``data.advantage.estimator: test_registry_distance_to_best`` in a YAML file: the round's advantages are what
    the function returns on the round's rewards (before: jsonargparse's Literal refused the name while parsing)."""
    monkeypatch.chdir(tmp_path)
    CALLS.clear()
    cli = GRPOCLI(args=["--config", write_config(tmp_path, estimator="test_registry_distance_to_best")], run=False)
    assert cli.datamodule.advantage.estimator == "test_registry_distance_to_best"
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    rollout = cli.datamodule.last_rollout
    assert CALLS and all(inputs.group_size == 4 for inputs in CALLS)
    expected = distance_to_best(SimpleNamespace(rewards=rollout.rewards, group_size=4))
    assert torch.equal(rollout.advantages, expected)
    assert rollout.advantages.min() < 0  # the completions scored differently: the check is not of zeros
    assert cli.trainer.global_step > 0


def test_an_estimator_by_import_path(tmp_path, monkeypatch):
    """``estimator: my_estimators:best_only`` imports the module when the config is read, as a loss by import path;
    the function need not be registered (a registered one is found under its registered name)."""
    source = "def best_only(inputs):\n    g = inputs.rewards.reshape(-1, inputs.group_size)\n"
    source += "    return (g == g.amax(dim=1, keepdim=True)).float().reshape(-1)\n"
    (tmp_path / "my_estimators.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_estimators", None)
    settings = round_settings(estimator="my_estimators:best_only")
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.5, 2.0, 2.0, 2.0, 2.0])
    advantages = compute_advantages(outcome_batch(rewards), settings)
    assert torch.equal(advantages, torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]))
    sys.modules.pop("my_estimators", None)


def test_the_readmes_estimator_runs_by_import_path(tmp_path, monkeypatch):
    """docs/losses.md's example, by import path: (r - mean) / (max - min + eps) in each group; the import registers it
    under its name too."""
    page = Path(__file__).resolve().parents[2] / "docs" / "losses.md"
    section = page.read_text().split("An estimator of your own", 1)[1]
    (tmp_path / "readme_estimators.py").write_text(re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("readme_estimators", None)
    rewards = torch.tensor([0.0, 1.0, 1.0, 2.0, 3.0, 3.0, 3.0, 3.0])
    advantages = compute_advantages(outcome_batch(rewards), round_settings(estimator="readme_estimators:group_range"))
    expected = torch.tensor([-1.0, 0.0, 0.0, 1.0]) / (2 + 1e-4)
    torch.testing.assert_close(advantages, torch.cat([expected, torch.zeros(4)]), rtol=0, atol=1e-7)
    assert "group_range" in available_advantage_estimators()
    with pytest.raises(
        ConfigError, match=r"data.advantage.k is read by estimator: passk only; leave it null \(got 3\)"
    ):
        AdvantageConfig(estimator="group_range", k=3)
    sys.modules.pop("readme_estimators", None)


@pytest.mark.parametrize(
    "field,value",
    [("estimator", "pass_at_k"), ("multi_objective_aggregation", "sum")],
)
def test_an_unknown_name_is_refused_in_one_line_naming_the_registered_ones(field, value):
    with pytest.raises(ConfigError) as error:
        AdvantageConfig(**{field: value})
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"data.advantage.{field} must be ") and f"(got {value!r})" in message
    registered = available_advantage_estimators() if field == "estimator" else ["sum_then_normalize"]
    assert all(name in message for name in registered)


def test_the_command_line_refuses_an_unknown_estimator_in_one_line(tmp_path, monkeypatch, capsys):
    """Through the CLI's entry point: exit status 2, one line naming the field, the value and the registered names
    (the user's included)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", write_config(tmp_path, estimator="bogus")])
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, lines
    assert "data.advantage.estimator must be " in lines[0] and "(got 'bogus')" in lines[0]
    assert "test_registry_distance_to_best" in lines[0] and "passk" in lines[0]


def test_a_setting_the_estimator_does_not_read_is_refused():
    """The user's estimator reads no setting: ``std: sample`` would be ignored, so it is refused."""
    with pytest.raises(ConfigError, match=r"data.advantage.std is read by estimator: .*grpo.* only") as error:
        AdvantageConfig(estimator="test_registry_distance_to_best", std="sample")
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="normalize_then_sum does not combine with estimator: test_registry_dist"):
        AdvantageConfig(estimator="test_registry_distance_to_best", multi_objective_aggregation="normalize_then_sum")


def test_a_user_estimator_takes_outcome_rewards_only_unless_it_says_so():
    with pytest.raises(ConfigError, match="data.advantage.estimator: test_registry_distance_to_best takes outcome"):
        AdvantageConfig(estimator="test_registry_distance_to_best").check_round(4, process_rewards=True)


def test_registering_refuses_a_taken_name_and_a_wrong_signature():
    with pytest.raises(ValueError, match="already registered as 'grpo'"):
        register_advantage_estimator("grpo")(distance_to_best)

    def positional(inputs, scale):
        return inputs.rewards

    with pytest.raises(ValueError, match="'scale' after inputs must be a keyword"):
        register_advantage_estimator("test_registry_positional")(positional)

    def unknown(inputs, *, temperature=1.0):
        return inputs.rewards

    with pytest.raises(ValueError, match="'temperature' is not a setting of data.advantage"):
        register_advantage_estimator("test_registry_unknown")(unknown)
    assert "test_registry_positional" not in available_advantage_estimators()


# --- every built-in, bit for bit what the pure function gives -------------------------------------------------------

G, GROUPS = 4, 5
# Five groups of 4: distinct values, a tie at the top, all equal, a tie below the top, one None row and a lone value.
TOTALS = [0.0, 1.0, 0.5, 0.25] + [1.0, 0.0, 1.0, 0.0] + [0.7] * 4 + [2.0, 1.0, 1.0, 0.0] + [0.3, 0.0, 0.9, 0.6]
UNSCORABLE = [False] * 16 + [False, True, False, False]
OTHER_RANK = torch.tensor([0.5, 3.0, float("nan"), 1.5] * 5)  # a second rank's rewards (NaN: unscorable there)


def all_gather(values: Tensor) -> Tensor:
    return torch.stack([values, OTHER_RANK.to(values.dtype)])


class Rollout(SimpleNamespace):
    """What ``compute_advantages`` and ``informative_groups`` read of a rollout of single completions."""

    def __len__(self) -> int:
        return self.rewards.numel()

    def per_trajectory(self) -> Rollout:
        return self


def outcome_batch(rewards: Tensor, unscorable: list[bool] | None = None, columns=None, weights=None) -> Rollout:
    """A rollout's rewards as the scorer leaves them (``tests/losses/test_gdpo.py``'s ``scored_batch``)."""
    columns = columns if columns is not None else {"total": rewards.tolist()}
    return Rollout(
        rewards=rewards,
        reward_columns=columns,
        reward_weights=weights or {},
        unscorable=None if unscorable is None else torch.tensor(unscorable),
        step_rewards=None,
    )


def round_settings(**advantage) -> RoundSettings:
    return RoundSettings(
        sampling=SamplingConfig(group_size=advantage.pop("group_size", G)),
        advantage=AdvantageConfig(**advantage),
        optimizer_steps=1,
    )


def gathered_std(rewards: Tensor, unscorable: list[bool], std: str) -> Tensor:
    """The std of every rank's scorable rewards (the code before the registry, in ``compute_advantages``)."""
    gathered = all_gather(torch.where(torch.tensor(unscorable), torch.nan, rewards.float())).flatten()
    return gathered[~gathered.isnan()].std(unbiased=std == "sample")


GRPO_SETTINGS = [
    {},
    {"baseline": "rloo"},
    {"scale": "none"},
    {"scale": "batch"},
    {"std": "sample", "eps": 1e-6},
    {"baseline": "rloo", "scale": "batch", "std": "sample"},
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("settings", GRPO_SETTINGS, ids=lambda s: "-".join(map(str, s.values())) or "default")
def test_grpo_is_group_advantages_bit_for_bit(settings, gather, dtype):
    rewards = torch.tensor(TOTALS, dtype=dtype)
    config = AdvantageConfig(**settings)
    batch_std = gathered_std(rewards, UNSCORABLE, config.std) if gather and config.scale == "batch" else None
    expected = group_advantages(
        rewards,
        G,
        baseline=config.baseline,
        scale=config.scale,
        std=config.std,
        eps=config.eps,
        batch_std=batch_std,
        scorable=~torch.tensor(UNSCORABLE),
    )
    actual = compute_advantages(
        outcome_batch(rewards, UNSCORABLE), round_settings(**settings), all_gather if gather else None
    )
    assert actual.dtype == expected.dtype and torch.equal(actual, expected)
    assert actual.abs().max() > 0.1


PASSK_SETTINGS = [
    {},
    {"k": 2},
    {"k": 3, "std": "sample"},
    {"scale": "none"},
    {"scale": "batch", "k": 3},
    {"scale": "batch", "std": "sample", "eps": 1e-6},
]


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("settings", PASSK_SETTINGS, ids=lambda s: "-".join(map(str, s.values())) or "default")
def test_passk_is_passk_advantages_bit_for_bit(settings, gather):
    rewards = torch.tensor(TOTALS)
    config = AdvantageConfig(estimator="passk", **settings)
    batch_std = gathered_std(rewards, UNSCORABLE, config.std) if gather and config.scale == "batch" else None
    expected = passk_advantages(
        rewards,
        G,
        config.k,
        scale=config.scale,
        std=config.std,
        eps=config.eps,
        batch_std=batch_std,
        scorable=~torch.tensor(UNSCORABLE),
    )
    settings = round_settings(estimator="passk", **settings)
    actual = compute_advantages(outcome_batch(rewards, UNSCORABLE), settings, all_gather if gather else None)
    assert torch.equal(actual, expected)
    assert actual.abs().max() > 0.1


COLUMNS = {
    "a": [1.0, 0.0, None, 1.0] + [0.5] * 4 + [None, 1.0, 0.0, 0.0] + [1.0, 1.0, 0.0, None] + [0.0, None, 1.0, 1.0],
    "b": [0.0, 2.0, 1.0, None] + [1.0, 0.0, 1.0, 0.0] + [None] * 4 + [3.0, 1.0, 1.0, 2.0] + [1.0, None, 0.0, 0.5],
    "env_c": [None] * 4 + [1.0, 1.0, 0.0, 0.0] + [0.2, 0.4, 0.6, 0.8] + [None] * 4 + [0.0, None, 0.0, 1.0],
}
WEIGHTS = {"a": 0.5, "b": 2.0}  # env_c: no source weighs it (1)


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("settings", [{}, {"std": "sample", "eps": 1e-3}], ids=["population", "sample"])
def test_gdpo_is_decoupled_sum_then_batch_normalized_bit_for_bit(settings, gather):
    unscorable = [all(COLUMNS[name][i] is None for name in COLUMNS) for i in range(G * GROUPS)]
    assert any(unscorable)  # row 17
    nan = float("nan")
    matrix = torch.tensor([[nan if v is None else v for v in COLUMNS[name]] for name in COLUMNS]).T
    config = AdvantageConfig(multi_objective_aggregation="normalize_then_sum", **settings)
    summed = decoupled_sum(matrix, torch.tensor([0.5, 2.0, 1.0]), G, eps=config.eps, std=config.std)
    batch = all_gather(summed).flatten() if gather else None
    expected = batch_normalized(summed, eps=config.eps, std=config.std, batch=batch)
    totals = torch.tensor([sum(WEIGHTS.get(n, 1.0) * (COLUMNS[n][i] or 0.0) for n in COLUMNS) for i in range(20)])
    rollout = outcome_batch(totals, unscorable, COLUMNS, WEIGHTS)
    settings = round_settings(multi_objective_aggregation="normalize_then_sum", **settings)
    actual = compute_advantages(rollout, settings, all_gather if gather else None)
    assert torch.equal(actual, expected)
    assert actual.abs().max() > 0.1
    # Without any reward column (the teacher alone) it is the estimator's, on the totals.
    no_columns = outcome_batch(torch.zeros(20), [True] * 20, columns={})
    assert torch.equal(compute_advantages(no_columns, settings), torch.zeros(20))


def test_process_rewards_are_added_to_the_grpo_estimators():
    """Step rewards: the per-token process advantages plus the outcome advantage on every completion token."""
    rewards = torch.tensor(TOTALS)
    rollout = outcome_batch(rewards)
    generator = torch.Generator().manual_seed(0)
    rollout.step_rewards = torch.rand(20, 3, generator=generator).round(decimals=1)
    rollout.step_rewards[torch.rand(20, 3, generator=generator) < 0.3] = torch.nan
    rollout.step_ends = torch.randint(0, 6, (20, 3), generator=generator).sort(dim=1).values
    rollout.completion_mask = (torch.arange(6)[None] < torch.randint(2, 7, (20, 1), generator=generator)).long()
    for settings in ({}, {"baseline": "rloo", "std": "sample"}):
        config = AdvantageConfig(**settings)
        outcome = group_advantages(rewards, G, baseline=config.baseline, std=config.std, eps=config.eps)
        steps = process_advantages(rollout.step_rewards, rollout.step_ends, rollout.completion_mask, G, std=config.std)
        expected = steps + outcome[:, None] * rollout.completion_mask
        assert torch.equal(compute_advantages(rollout, round_settings(**settings)), expected)


def test_informative_groups_ask_the_registered_estimator():
    """Dynamic sampling's question goes through the same lookup: the user's estimator gives the best 0, so a group
    whose completions all tie is uninformative, and the others not."""
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0] + [0.0, 1.0, 0.0, 0.0])
    rollout = outcome_batch(rewards)
    settings = round_settings(estimator="test_registry_distance_to_best")
    assert informative_groups(rollout, settings).tolist() == [False, True]
