"""The DataModule takes ``data``'s settings in the groups the YAML has (issue 51, point 5): ``sampling``,
``advantage``, ``update`` (μ, batch sizes, π_old's source), ``schedule`` (the lag's settings), ``eval``; its
constructor is short and hands the collector the group objects themselves, no setting passed on one by one."""

from __future__ import annotations

import inspect

from grpo_lightning import (
    AdvantageConfig,
    EvalConfig,
    RolloutDataModule,
    SamplingConfig,
    ScheduleConfig,
    UpdateConfig,
)
from grpo_lightning.rollout.collector import RolloutCollector

MAX_DATAMODULE_PARAMETERS = 25
MAX_COLLECTOR_PARAMETERS = 9
# Settings that live in a group now: never a constructor's parameter of their own.
GROUPED = {
    "num_iterations", "mini_batch_size", "micro_batch_size", "balance_micro_batches", "pack_tokens", "old_logprobs",
    "mask_truncated_completions", "rollout_lag", "off_policy_correction", "rollout_threads", "rollout_timeout_s",
    "dynamic_sampling", "max_sampling_rounds", "val_batch_size", "val_limit",
}  # fmt: skip


def parameters(function) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


def test_the_constructors_take_the_groups_not_their_settings():
    data, collector = parameters(RolloutDataModule.__init__), parameters(RolloutCollector.__init__)
    assert len(data) <= MAX_DATAMODULE_PARAMETERS, data
    assert len(collector) <= MAX_COLLECTOR_PARAMETERS, collector
    assert not GROUPED & {*data, *collector}
    assert {"sampling", "advantage", "update", "schedule", "eval"} <= set(data)
    assert {"sampling", "advantage", "update", "schedule"} <= set(collector)


def test_the_collector_receives_the_group_objects_themselves():
    sampling, advantage = SamplingConfig(group_size=4, dynamic_sampling=True), AdvantageConfig(scale="none")
    update, schedule = UpdateConfig(num_iterations=2, mini_batch_size=8), ScheduleConfig(rollout_timeout_s=60.0)
    evaluation = EvalConfig(batch_size=4, limit=2)
    data = RolloutDataModule(
        sampling=sampling, advantage=advantage, update=update, schedule=schedule, eval=evaluation, prompts_per_round=4
    )
    collector = data.collector
    assert collector.sampling is sampling and collector.advantage is advantage
    assert collector.update is update and collector.schedule is schedule
    assert data.eval is evaluation and data.update is update and data.schedule is schedule
    plan = collector.plan  # read from the group: 16 rows, mini-batches of 8, μ = 2
    assert (plan.rows_per_round, plan.mini_batch_size, plan.optimizer_steps) == (16, 8, 4)


def test_groups_left_unset_take_their_defaults():
    data = RolloutDataModule()
    assert data.update == UpdateConfig() and data.schedule == ScheduleConfig() and data.eval == EvalConfig()
    assert data.collector.update is data.update and data.collector.background is None
