"""The update half of a round (``grpo_lightning/update_plan.py``): μ passes × mini-batches × micro-batches, planned
in one place, and the round's metrics reaching the logger by a named path (not inside a micro-batch's dict)."""

from __future__ import annotations

import csv
import math

import pytest
import torch
from conftest import TINY, quiet_trainer
from helpers import length_reward
from lightning import Callback
from lightning.pytorch.loggers import CSVLogger

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.config import ConfigError, EvalConfig, UpdateConfig
from grpo_lightning.config_checks import check_accumulation
from grpo_lightning.rewards import RewardSpec, register
from grpo_lightning.rollout.batch import RolloutBatch, balanced_split
from grpo_lightning.update_plan import UpdatePlan, plan_update

register("test_plan_length")(length_reward)


class RoundRecorder(Callback):
    """Every micro-batch's keys; at each round's end, its rollout's metrics and the global step."""

    def __init__(self) -> None:
        self.batch_keys: list[set[str]] = []
        self.rounds: list[tuple[int, dict[str, float]]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.batch_keys.append(set(batch))

    def on_train_epoch_end(self, trainer, module):
        self.rounds.append((trainer.global_step, dict(trainer.datamodule.last_rollout.metrics)))


def logged_run(tmp_path, *, mu: int, mini: int | None, micro: int | None, dynamic: bool = False):
    """Two rounds of 4 prompts × G = 4 logged to CSV; the recorder and the CSV's rows."""
    module = GRPOModule(tiny_model=TINY, objective=ObjectiveConfig(beta=0.04), lr=1e-3)
    data = RolloutDataModule(
        rewards=[RewardSpec("test_plan_length")],
        sampling=SamplingConfig(group_size=4, max_new_tokens=4, dynamic_sampling=dynamic),
        update=UpdateConfig(num_iterations=mu, mini_batch_size=mini, micro_batch_size=micro),
        prompts_per_round=4,
        eval=EvalConfig(limit=8),
        task_kwargs={"test_size": 50},
    )
    recorder = RoundRecorder()
    accumulate = (mini or 16) // (micro or mini or 16)
    logger = CSVLogger(tmp_path, name="csv", version=0)
    trainer = quiet_trainer(
        tmp_path,
        max_epochs=2,
        accumulate_grad_batches=accumulate,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[recorder],
    )
    trainer.fit(module, datamodule=data)
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return module, data, recorder, rows


@pytest.mark.parametrize("mu,mini,micro,dynamic", [(2, 8, 4, False), (1, None, None, False), (1, 4, 2, True)])
def test_the_round_metrics_are_logged_once_per_round_at_its_last_step(tmp_path, mu, mini, micro, dynamic):
    """What a round's rollout measured reaches the logger once, at the round's last optimizer step, every key with
    its value (as logged before the plan: the same keys, values and steps)."""
    _, data, recorder, rows = logged_run(tmp_path, mu=mu, mini=mini, micro=micro, dynamic=dynamic)
    steps_per_round = mu * 16 // (mini or 16)
    logged = [row for row in rows if row["rollout/reward_mean"]]
    assert len(logged) == len(recorder.rounds) == 2  # once per round
    for row, (global_step, metrics) in zip(logged, recorder.rounds):
        assert int(row["step"]) == global_step - 1  # the round's last step
        keys = {key for key, value in row.items() if value and key not in ("epoch", "step")}
        keys = {key for key in keys if not key.startswith("train/")}
        assert keys == {key for key, value in metrics.items() if not math.isnan(value)}
        for key in keys:
            assert float(row[key]) == pytest.approx(float(torch.tensor(metrics[key])), rel=1e-6, abs=1e-9), key
    # the update's own metrics: one row per optimizer step
    assert len([row for row in rows if row["train/loss"]]) == 2 * steps_per_round


def test_micro_batches_carry_the_loss_inputs_only(tmp_path):
    """No micro-batch dict carries the round's metrics (the collector hands them to the module by name)."""
    _, _, recorder, _ = logged_run(tmp_path, mu=2, mini=8, micro=4)
    assert len(recorder.batch_keys) == 2 * 8
    assert all("rollout_metrics" not in keys for keys in recorder.batch_keys)


# ------------------------------------------------------------------------------------------ the plan's numbers
# (prompts_per_round, G, μ, mini, micro) → (rows, mini, micro, accumulation, optimizer steps, micro-batches), as
# the collector, the DataModule and the config checks computed them before the plan.
PLANS = {
    "whole_rollout": ((4, 4, 1, None, None), (16, 16, 16, 1, 1, 1)),
    "mu2_mini_lt_rollout": ((4, 4, 2, 8, None), (16, 8, 8, 1, 4, 4)),
    "mu2_micro_lt_mini": ((4, 4, 2, 8, 4), (16, 8, 4, 2, 4, 8)),
    "mu1_small_steps": ((4, 4, 1, 4, 2), (16, 4, 2, 2, 4, 8)),
    "mu3_micro_only": ((3, 2, 3, None, 3), (6, 6, 3, 2, 3, 6)),
    "group_of_one": ((5, 1, 2, 5, 1), (5, 5, 1, 5, 2, 10)),
}


@pytest.mark.parametrize("settings,expected", PLANS.values(), ids=PLANS.keys())
def test_the_plan_of_the_settings(settings, expected):
    prompts, group, mu, mini, micro = settings
    update = UpdateConfig(num_iterations=mu, mini_batch_size=mini, micro_batch_size=micro)
    plan = plan_update(update, prompts_per_round=prompts, group_size=group)
    plan.check()
    numbers = (plan.rows_per_round, plan.mini_batch_size, plan.micro_batch_size, plan.micro_batches_per_step)
    assert (*numbers, plan.optimizer_steps, plan.micro_batches_per_round) == expected
    assert plan.optimizer_steps == mu * plan.mini_batches_per_pass


def test_each_micro_batch_knows_its_place_and_the_step_ends_where_lightning_steps():
    plan = UpdatePlan(num_iterations=2, rows_per_round=16, mini_batch_size=8, micro_batch_size=4)
    places = [plan.place(i) for i in range(plan.micro_batches_per_round)]
    assert [(p.iteration, p.mini_batch, p.micro_batch) for p in places] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)
    ]  # fmt: skip
    # Lightning steps after every accumulate_grad_batches-th batch: (batch_idx + 1) % accumulation == 0
    assert [p.ends_step for p in places] == [(i + 1) % plan.micro_batches_per_step == 0 for i in range(8)]


@pytest.mark.parametrize(
    "mini,micro,message",
    [
        (
            6,
            None,
            r"^data.update.mini_batch_size \(6\) must divide the rollout of prompts_per_round × group_size = 16$",
        ),
        (8, 3, r"^data.update.micro_batch_size \(3\) must divide data.update.mini_batch_size \(8\)$"),
        (None, 32, r"^data.update.micro_batch_size \(32\) must divide data.update.mini_batch_size \(16\)$"),
    ],
)
def test_sizes_that_do_not_divide_are_refused_by_the_plan(mini, micro, message):
    update = UpdateConfig(mini_batch_size=mini, micro_batch_size=micro)
    plan = plan_update(update, prompts_per_round=4, group_size=4)
    with pytest.raises(ConfigError, match=message):
        plan.check()
    with pytest.raises(ConfigError, match=message):  # the Trainer's check reads the same plan
        check_accumulation(1, plan)


def test_the_trainer_accumulation_is_checked_against_the_plan():
    plan = plan_update(
        UpdateConfig(num_iterations=2, mini_batch_size=8, micro_batch_size=2), prompts_per_round=4, group_size=4
    )
    check_accumulation(4, plan)
    with pytest.raises(ConfigError, match=r"^trainer.accumulate_grad_batches = 1, but .* = 4 micro-batches"):
        check_accumulation(1, plan)
    with pytest.raises(ConfigError, match=r"^trainer.accumulate_grad_batches = 3 contradicts .* = 4"):
        check_accumulation(3, plan)


# ------------------------------------------------------------------------------------------------ the cut
def rollout_of(rows_per_trajectory: list[int], width: int = 6) -> RolloutBatch:
    """A batch whose row i's completion starts with token i (rows told apart), trajectory lengths varying."""
    counts = torch.tensor(rows_per_trajectory)
    n = int(counts.sum())
    generator = torch.Generator().manual_seed(0)
    completion_ids = torch.randint(3, 30, (n, width), generator=generator)
    completion_ids[:, 0] = torch.arange(n) + 100
    completion_mask = (torch.arange(width) < torch.randint(1, width + 1, (n, 1), generator=generator)).long()
    batch = RolloutBatch(
        prompt_ids=torch.randint(3, 30, (n, 3), generator=generator),
        prompt_mask=torch.ones(n, 3, dtype=torch.long),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        truncated=torch.zeros(n, dtype=torch.bool),
        rewards=torch.rand(n, generator=generator),
        advantages=torch.randn(n, generator=generator),
    )
    if any(count > 1 for count in rows_per_trajectory):
        batch.trajectory = torch.arange(len(counts)).repeat_interleave(counts)
    return batch


def cut_before_the_plan(batch, *, micro, mini, mu, generator, balance):
    """``RolloutBatch.micro_batches``'s rows as the code before the plan chose them (kept here to compare)."""
    n = len(batch)
    planned = n if batch.trajectory is None else int(batch.trajectory_starts().sum())
    steps = -(-planned // mini)
    minis = [
        m
        for order in (torch.randperm(n, generator=generator) for _ in range(mu))
        for m in (order.split(mini) if n == planned else order.tensor_split(steps))
    ]
    lengths = batch.completion_mask.sum(1) if balance else None
    out = []
    for m in minis:
        parts = max((len(m) if n == planned else mini) // micro, 1)
        split = m.split(micro) if n == planned else m.tensor_split(parts)
        out += [rows.tolist() for rows in (balanced_split(m, parts, lengths) if balance else split)]
    return out


CUTS = {
    "rows_are_trajectories": ([1] * 16, 2, 8, 4),
    "whole_rollout": ([1] * 16, 1, 16, 16),
    "agent_sessions_more_rows": ([2, 1, 3, 1, 1, 2, 1, 1], 2, 4, 2),
    "agent_sessions_one_step": ([2, 2, 2, 2], 1, 4, 2),
}


@pytest.mark.parametrize("balance", [False, True])
@pytest.mark.parametrize("sessions,mu,mini,micro", CUTS.values(), ids=CUTS.keys())
def test_the_plan_cuts_the_round_as_before(sessions, mu, mini, micro, balance):
    """The same rows in the same micro-batches, in the same order, as before the plan (μ 1/2, mini < rollout,
    micro < mini, an agent's sessions making more rows than trajectories, balanced or not)."""
    batch = rollout_of(sessions)
    plan = UpdatePlan(num_iterations=mu, rows_per_round=len(sessions), mini_batch_size=mini, micro_batch_size=micro)
    plan.check()
    before = cut_before_the_plan(
        batch, micro=micro, mini=mini, mu=mu, generator=torch.Generator().manual_seed(3), balance=balance
    )
    after = batch.micro_batches(plan, generator=torch.Generator().manual_seed(3), balance_tokens=balance)
    assert len(after) == len(before) == plan.micro_batches_per_round
    assert [(mb["completion_ids"][:, 0] - 100).tolist() for mb in after] == before
    assert all("rollout_metrics" not in mb for mb in after)


def test_a_round_of_another_size_than_planned_is_a_bug():
    plan = UpdatePlan(num_iterations=1, rows_per_round=8, mini_batch_size=4, micro_batch_size=2)
    with pytest.raises(RuntimeError, match="the round has 6 trajectories, 8 were planned"):
        rollout_of([1] * 6).micro_batches(plan, generator=torch.Generator())
