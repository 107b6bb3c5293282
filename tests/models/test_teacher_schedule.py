"""The teacher's weight over the rounds (``model.teacher.weight_schedule``, ``weight_rounds``;
``grpo_lightning/integrations/distillation/teacher.py``): λ per round against values computed by hand, the refusals in
one line (from the config and through the CLI), and a run whose rounds take the scheduled λ and, once it is 0, no
teacher pass.
"""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from conftest import TINY, quiet_trainer
from test_distillation import save_teacher
from test_loss_ranges import BASE, refused

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.config import ConfigError
from grpo_lightning.integrations.distillation.teacher import Teacher, TeacherConfig
from grpo_lightning.models.logprobs import completion_logprobs
from grpo_lightning.rewards import RewardSpec

# λ = 2, N = 4 rounds, rounds 1..6 (round_index 0..5), by hand:
#   linear  2 · (1 − k/4)                 → 2, 1.5, 1, 0.5, 0, 0
#   cosine  2 · ½ (1 + cos(π k/4))        → 2, 1 + √2/2, 1, 1 − √2/2, 0, 0
#   step    2 for the first 4 rounds      → 2, 2, 2, 2, 0, 0
HALF_SQRT2 = math.sqrt(2) / 2
EXPECTED = {
    "constant": [2.0, 2.0, 2.0, 2.0, 2.0, 2.0],
    "linear": [2.0, 1.5, 1.0, 0.5, 0.0, 0.0],
    "cosine": [2.0, 1.0 + HALF_SQRT2, 1.0, 1.0 - HALF_SQRT2, 0.0, 0.0],
    "step": [2.0, 2.0, 2.0, 2.0, 0.0, 0.0],
}


@pytest.mark.parametrize("schedule", sorted(EXPECTED))
def test_the_weight_per_round_follows_its_schedule(schedule):
    rounds = None if schedule == "constant" else 4
    config = TeacherConfig("folder", weight=2.0, weight_schedule=schedule, weight_rounds=rounds)
    assert [config.weight_at(k) for k in range(6)] == pytest.approx(EXPECTED[schedule], abs=1e-12)
    assert config.weight_at(1000) == EXPECTED[schedule][-1]  # stays where it ended


def test_a_one_round_schedule_teaches_the_first_round_only():
    for schedule in ("linear", "cosine", "step"):
        config = TeacherConfig("folder", weight=0.3, weight_schedule=schedule, weight_rounds=1)
        assert (config.weight_at(0), config.weight_at(1)) == (0.3, 0.0), schedule


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"weight_schedule": "exponential"},
            r"^model.teacher.weight_schedule must be constant, linear, cosine or step",
        ),
        ({"weight_schedule": "linear"}, r"^model.teacher.weight_schedule: linear needs model.teacher.weight_rounds"),
        ({"weight_schedule": "step", "weight_rounds": 0}, r"weight_rounds, the rounds over which .* \(got 0\)$"),
        ({"weight_schedule": "cosine", "weight_rounds": 2.5}, r"an integer >= 1 \(got 2.5\)$"),
        ({"weight_rounds": 10}, r"^model.teacher.weight_rounds \(10\) applies to a linear, cosine or step"),
    ],
)
def test_a_bad_schedule_is_refused_in_one_line(settings, message):
    with pytest.raises(ConfigError, match=message) as err:
        TeacherConfig("folder", **settings)
    assert "\n" not in str(err.value)


def test_a_bad_schedule_ends_the_run_when_the_config_is_read(capsys, tmp_path, monkeypatch):
    """Through the CLI: one error line naming the setting, before any model (the teacher's folder is not even
    read: it does not exist)."""

    def no_model(*_args, **_kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(GRPOModule, "configure_model", no_model)
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(BASE))
    teacher = ["--model.teacher.model_name_or_path", str(tmp_path / "absent")]
    line = refused(capsys, config, [*teacher, "--model.teacher.weight_schedule", "linear"])
    assert "model.teacher.weight_schedule: linear needs model.teacher.weight_rounds" in line, line
    line = refused(capsys, config, [*teacher, "--model.teacher.weight_rounds", "5"])
    assert "model.teacher.weight_rounds (5) applies to a linear, cosine or step weight_schedule only" in line, line


def test_a_run_takes_each_rounds_weight_and_no_teacher_pass_once_it_is_0(tmp_path, monkeypatch):
    """Linear over 2 rounds at λ 0.8: round 1 at 0.8, round 2 at 0.4 (its advantage the reward's plus 0.4 times the
    log-prob gap), round 3 at 0: the rewards' advantage alone, one per completion, and the teacher never asked."""
    passes: list[int] = []
    real_logprobs = Teacher.logprobs

    def counted(self, *args, **kwargs):
        passes.append(1)
        return real_logprobs(self, *args, **kwargs)

    monkeypatch.setattr(Teacher, "logprobs", counted)
    teacher = TeacherConfig(save_teacher(tmp_path / "teacher"), weight=0.8, weight_schedule="linear", weight_rounds=2)
    module = GRPOModule(tiny_model=TINY, objective=ObjectiveConfig(beta=0.0), lr=1e-3, teacher=teacher)
    data = RolloutDataModule(
        rewards=[RewardSpec("exact_answer", weight=1.0)],
        sampling=SamplingConfig(group_size=2, max_new_tokens=4),
        prompts_per_round=2,
        val_split=None,
    )
    weights: list[float | None] = []  # each round's λ as its metrics log it (none once the teacher is off)
    original_collect = data.collector.collect

    def collect(round_index):
        rollout, batches = original_collect(round_index)
        weights.append(rollout.metrics.get("distill/weight"))
        if round_index == 1:
            args = (rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask)
            with torch.no_grad():
                taught = completion_logprobs(module.teacher.model, *args, temperature=rollout.temperature)[0]
            gap = (taught - rollout.old_logprobs) * rollout.loss_mask
            rewards_only = rollout.advantages - 0.4 * gap
            # what remains is the rewards' advantage: one value per completion (its first token's), on each token
            per_completion = rewards_only[:, 0]
            assert torch.allclose(rewards_only, per_completion[:, None] * rollout.completion_mask, atol=1e-5)
        if round_index == 2:
            assert rollout.advantages.dim() == 1  # the rewards' group advantage alone
        return rollout, batches

    monkeypatch.setattr(data.collector, "collect", collect)
    quiet_trainer(tmp_path / "run", max_epochs=3).fit(module, datamodule=data)
    assert weights == [pytest.approx(0.8), pytest.approx(0.4), None]
    assert len(passes) == 2  # rounds 1 and 2; round 3 ran no teacher pass


def test_a_schedule_that_stops_the_teacher_needs_a_reward_that_teaches_and_is_refused_without_one(tmp_path):
    """The teacher alone (the reward at weight 0) under a step schedule would leave the rounds after it with no
    signal: refused before training, in one line; with the reward weighed, the same schedule is accepted."""
    teacher = TeacherConfig(save_teacher(tmp_path / "teacher"), weight_schedule="step", weight_rounds=3)

    def data(weight: float) -> RolloutDataModule:
        return RolloutDataModule(
            rewards=[RewardSpec("exact_answer", weight=weight)],
            sampling=SamplingConfig(group_size=2, max_new_tokens=4),
            prompts_per_round=2,
            val_split=None,
        )

    module = GRPOModule(tiny_model=TINY, teacher=teacher)
    with pytest.raises(
        ConfigError, match=r"^model.teacher.weight_schedule: step stops the teacher after 3 rounds"
    ) as err:
        quiet_trainer(tmp_path / "alone", max_epochs=1).fit(module, datamodule=data(0.0))
    assert "\n" not in str(err.value) and module.teacher.model is None  # before any model loads
    accepted = GRPOModule(tiny_model=TINY, teacher=teacher)
    quiet_trainer(tmp_path / "rewarded", max_epochs=1).fit(accepted, datamodule=data(1.0))
    assert accepted.teacher.model is not None
