"""On-policy distillation (``model.teacher``, ``grpo_lightning/integrations/distillation/teacher.py``).

The per-token quantities against TRL 1.16's ``DistillationTrainer`` (its reverse KL at beta = 1, on the same
logits), the sampled advantage as an estimate of minus that KL, the refusals, and a run where the teacher's
log-probs reach each token's advantage.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TINY, quiet_trainer

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.config import ConfigError
from grpo_lightning.integrations.distillation.teacher import (
    TeacherConfig,
    check_same_vocabulary,
    distillation_advantages,
    reverse_kl_per_token,
)
from grpo_lightning.models.tiny import build_char_tokenizer, build_tiny_llama
from grpo_lightning.rewards import RewardSpec


def logits_of(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return hidden @ weight.T


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_per_token_reverse_kl_equals_trls_distillation_divergence(temperature):
    """TRL's per-token divergence at beta = 1 (reverse KL), read one position at a time through its loss."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    torch.manual_seed(0)
    rows, length, width, vocab = 2, 5, 8, 11
    # Logits of a trained model's spread (divergences near 0.5): TRL's kernel computes in float32, whose rounding
    # of a divergence near 5 would already be 5e-7.
    student_h, teacher_h = 0.3 * torch.randn(rows, length, width), 0.3 * torch.randn(rows, length, 6)  # widths differ
    student_w, teacher_w = torch.randn(vocab, width), torch.randn(vocab, 6)
    ours = reverse_kl_per_token(logits_of(student_h, student_w), logits_of(teacher_h, teacher_w), temperature)
    gaps = []
    for row in range(rows):
        for position in range(length):
            mask = torch.zeros(rows, length)
            mask[row, position] = 1
            trl, _, count = _chunked_divergence_loss(
                student_h, teacher_h, student_w, teacher_w, mask, beta=1.0, temperature=temperature
            )
            assert count == 1
            gaps.append(abs(trl.item() - ours[row, position].item()))
    assert max(gaps) < 1e-6
    assert ours.min() > 0  # a real divergence: the two heads differ everywhere


def test_the_sampled_advantage_estimates_minus_the_reverse_kl():
    """E_{y ~ π_S}[log π_T(y) − log π_S(y)] = −KL(π_S ‖ π_T): the advantage a token gets is, on average, minus the
    divergence TRL minimises (k1 on the student's own samples)."""
    generator = torch.Generator().manual_seed(1)
    student_logits, teacher_logits = torch.randn(7, generator=generator), torch.randn(7, generator=generator)
    student, teacher = student_logits.log_softmax(-1), teacher_logits.log_softmax(-1)
    draws = torch.multinomial(student.exp(), 400_000, replacement=True, generator=generator)
    gap = teacher[draws] - student[draws]
    mask = torch.ones_like(gap)
    advantages = distillation_advantages(gap, mask, weight=0.5)
    exact = reverse_kl_per_token(student_logits, teacher_logits).item()
    error = 4 * gap.std().item() / len(gap) ** 0.5
    assert abs(advantages.mean().item() / 0.5 + exact) < error
    assert exact > 0.1  # far enough from 0 that the sign is checked


def test_distillation_advantages_are_zero_outside_the_mask():
    gap = torch.tensor([[0.5, -1.0, 2.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert torch.equal(distillation_advantages(gap, mask, 2.0), torch.tensor([[1.0, -2.0, 0.0], [2.0, 0.0, 0.0]]))


def test_a_teacher_with_another_vocabulary_or_bad_settings_is_refused_in_one_line():
    student = build_char_tokenizer()
    check_same_vocabulary(student, build_char_tokenizer(), "same")  # accepted
    other = build_char_tokenizer()
    other.add_tokens(["<extra>"])
    with pytest.raises(ConfigError, match=r"^model.teacher 'other' has another vocabulary than the student") as err:
        check_same_vocabulary(student, other, "other")
    assert "\n" not in str(err.value)
    for bad, message in (
        ({"weight": 0.0}, "weight must be > 0"),
        ({"dtype": "int8"}, "dtype must be auto"),
        ({"temperature": 0.0}, r"^model.teacher.temperature must be > 0 or null \(got 0.0\)$"),
        ({"temperature": -1.0}, "temperature must be > 0"),
    ):
        with pytest.raises(ConfigError, match=message):
            TeacherConfig("folder", **bad)


def save_teacher(folder, config=TINY) -> str:
    """A tiny model of the student's architecture and tokenizer, with other weights: the teacher."""
    tokenizer = build_char_tokenizer()
    torch.manual_seed(7)
    build_tiny_llama(config, tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return save_teacher(tmp_path_factory.mktemp("teacher"))


def test_a_teacher_whose_context_is_shorter_than_prompt_and_completion_is_refused_before_training(tmp_path):
    from dataclasses import replace

    short = save_teacher(tmp_path / "short", replace(TINY, max_position_embeddings=12))
    module = GRPOModule(tiny_model=TINY, teacher=TeacherConfig(short))
    data = RolloutDataModule(sampling=SamplingConfig(group_size=2, max_new_tokens=8), prompts_per_round=2)
    trainer = quiet_trainer(tmp_path, max_epochs=1)
    with pytest.raises(ConfigError, match=r"model.teacher's context") as err:
        trainer.fit(module, datamodule=data)
    assert "\n" not in str(err.value) and module.teacher.model is None  # before any model loads


def test_a_run_with_a_teacher_gives_each_token_its_log_prob_gap_as_advantage(tmp_path, teacher_dir):
    module = GRPOModule(
        tiny_model=TINY, objective=ObjectiveConfig(beta=0.0), lr=1e-3, teacher=TeacherConfig(teacher_dir, weight=0.5)
    )
    data = RolloutDataModule(
        rewards=[RewardSpec("exact_answer", weight=0.0)],  # the teacher alone teaches
        sampling=SamplingConfig(group_size=2, max_new_tokens=4),
        prompts_per_round=2,
        val_split=None,
    )
    trainer = quiet_trainer(tmp_path, max_epochs=1)
    trainer.fit(module, datamodule=data)
    rollout = data.last_rollout
    args = (rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask)
    from grpo_lightning.models.logprobs import completion_logprobs

    with torch.no_grad():
        teacher = completion_logprobs(module.teacher.model, *args, temperature=rollout.temperature)[0]
    expected = 0.5 * (teacher - rollout.old_logprobs) * rollout.loss_mask
    assert rollout.advantages.shape == rollout.completion_mask.shape  # per token
    assert torch.allclose(rollout.advantages, expected, atol=1e-5)
    assert rollout.advantages[rollout.loss_mask.bool()].abs().min() > 0
    assert rollout.metrics["distill/reverse_kl_k1"] == pytest.approx(
        -(teacher - rollout.old_logprobs)[rollout.loss_mask.bool()].mean().item(), abs=1e-5
    )
    assert not any(name.startswith("teacher") for name in module.state_dict())  # never in checkpoints


def test_no_rewards_with_a_teacher_is_the_teacher_alone_and_without_one_is_refused(tmp_path, teacher_dir):
    def data() -> RolloutDataModule:
        return RolloutDataModule(
            rewards=[], sampling=SamplingConfig(group_size=2, max_new_tokens=4), prompts_per_round=2, val_split=None
        )

    with pytest.raises(ConfigError, match=r"^data.rewards is empty and neither model.teacher") as err:
        quiet_trainer(tmp_path / "alone", max_epochs=1).fit(GRPOModule(tiny_model=TINY), datamodule=data())
    assert "\n" not in str(err.value)
    module, taught = GRPOModule(tiny_model=TINY, teacher=TeacherConfig(teacher_dir)), data()
    quiet_trainer(tmp_path / "taught", max_epochs=1).fit(module, datamodule=taught)
    rollout = taught.last_rollout
    assert taught.scorer.names == [] and not any(name.startswith("reward/") for name in rollout.metrics)
    assert rollout.advantages[rollout.loss_mask.bool()].abs().min() > 0  # the teacher's signal alone


def test_one_sample_per_prompt_is_the_teacher_alone_and_is_refused_where_a_reward_would_teach(tmp_path, teacher_dir):
    """``data.sampling.group_size`` 1: a group of one has no baseline, so every reward's advantage would be 0. With
    a teacher and the rewards at weight 0 it is on-policy distillation on more prompts (each token's advantage the
    log-prob gap, finite metrics); with a reward that would teach, or without a teacher, refused in one line before
    any model loads; 0 is refused when the config is read."""
    from grpo_lightning.models.logprobs import completion_logprobs

    def data(weight: float, dynamic_sampling: bool = False) -> RolloutDataModule:
        return RolloutDataModule(
            rewards=[RewardSpec("exact_answer", weight=weight)],
            sampling=SamplingConfig(group_size=1, max_new_tokens=4, dynamic_sampling=dynamic_sampling),
            prompts_per_round=4,
            val_split=None,
        )

    message = r"^data.sampling.group_size 1 gives every reward a zero advantage .* set group_size >= 2, or use it "
    for name, module, weight in [
        ("untaught", GRPOModule(tiny_model=TINY), 1.0),
        ("rewarded", GRPOModule(tiny_model=TINY, teacher=TeacherConfig(teacher_dir)), 1.0),
    ]:
        with pytest.raises(ConfigError, match=message) as err:
            quiet_trainer(tmp_path / name, max_epochs=1).fit(module, datamodule=data(weight))
        assert "\n" not in str(err.value)
        assert module.teacher is None or module.teacher.model is None  # before any teacher loads
    with pytest.raises(ConfigError, match=r"^data.sampling.group_size must be at least 1 \(got 0\)"):
        SamplingConfig(group_size=0)
    dynamic = data(0.0, dynamic_sampling=True)
    with pytest.raises(
        ConfigError, match=r"^data.sampling.dynamic_sampling drops every group .* with data.sampling.group_size 1"
    ):
        teacher_module = GRPOModule(tiny_model=TINY, teacher=TeacherConfig(teacher_dir))
        quiet_trainer(tmp_path / "dynamic", max_epochs=1).fit(teacher_module, datamodule=dynamic)

    module = GRPOModule(tiny_model=TINY, objective=ObjectiveConfig(beta=0.0), teacher=TeacherConfig(teacher_dir))
    taught = data(0.0)
    quiet_trainer(tmp_path / "taught", max_epochs=1).fit(module, datamodule=taught)
    rollout = taught.last_rollout
    assert len(rollout) == 4  # one completion for each of the round's 4 prompts
    args = (rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask)
    with torch.no_grad():
        teacher = completion_logprobs(module.teacher.model, *args, temperature=rollout.temperature)[0]
    assert torch.allclose(rollout.advantages, (teacher - rollout.old_logprobs) * rollout.loss_mask, atol=1e-5)
    metrics = rollout.metrics
    assert all(math.isfinite(value) for value in metrics.values()), metrics
    assert metrics["rollout/zero_std_group_fraction"] == 1.0 and "reward/exact_answer" in metrics


@pytest.mark.parametrize("teacher_temperature", [None, 0.5])
def test_the_teacher_scores_at_its_own_temperature_the_student_at_the_sampling_one(
    tmp_path, teacher_dir, teacher_temperature
):
    """``model.teacher.temperature`` (τ_T) divides the teacher's logits (unset: by the sampling temperature, 0.8
    here); the advantage is its log-prob minus π_S's as recorded (at the sampling temperature)."""
    from grpo_lightning.models.logprobs import completion_logprobs

    teacher = TeacherConfig(teacher_dir, temperature=teacher_temperature)
    module = GRPOModule(tiny_model=TINY, objective=ObjectiveConfig(beta=0.0), teacher=teacher)
    data = RolloutDataModule(
        rewards=[RewardSpec("exact_answer", weight=0.0)],
        sampling=SamplingConfig(group_size=2, max_new_tokens=4, temperature=0.8),
        prompts_per_round=2,
        val_split=None,
    )
    quiet_trainer(tmp_path, max_epochs=1).fit(module, datamodule=data)
    rollout = data.last_rollout
    args = (rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask)
    expected_temperature = 0.8 if teacher_temperature is None else teacher_temperature
    with torch.no_grad():
        scored = completion_logprobs(module.teacher.model, *args, temperature=expected_temperature)[0]
        other = completion_logprobs(module.teacher.model, *args, temperature=1.3 - expected_temperature)[0]
    tokens = rollout.loss_mask.bool()
    assert torch.allclose(rollout.advantages, (scored - rollout.old_logprobs) * rollout.loss_mask, atol=1e-5)
    assert (other - scored)[tokens].abs().max() > 1e-2  # the temperature changes the teacher's log-probs
