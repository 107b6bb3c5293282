"""The pass-rate curriculum: draw frequencies follow its rule, rates follow the rollouts, state survives a restart."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

from grpo_lightning.cli import GRPOCLI
from grpo_lightning.config import ConfigError
from grpo_lightning.rollout.batch import RolloutBatch
from grpo_lightning.rollout.curriculum import (
    PREFERRED,
    TOO_EASY,
    TOO_HARD,
    UNSEEN,
    CurriculumConfig,
    CurriculumSampler,
)
from grpo_lightning.rollout.datamodule import RolloutDataModule


def sampler_with_rates(rates: list[float], **config: float) -> CurriculumSampler:
    sampler = CurriculumSampler(CurriculumConfig(**config), seed=0)
    sampler.pass_rates = torch.tensor(rates)
    return sampler


def test_categories_use_inclusive_bounds():
    sampler = sampler_with_rates([math.nan, 0.0, 0.2, 0.5, 0.8, 1.0], min_pass_rate=0.2, max_pass_rate=0.8)
    assert sampler.categories().tolist() == [UNSEEN, TOO_HARD, PREFERRED, PREFERRED, PREFERRED, TOO_EASY]


def test_draw_frequencies_follow_the_weights():
    # weights: unseen 1, in band 3, never solved 0.5, always solved 0.5 → probabilities .2, .6, .1, .1
    sampler = sampler_with_rates([math.nan, 0.5, 0.0, 1.0], preferred_weight=3.0, unseen_weight=1.0, other_weight=0.5)
    counts = torch.zeros(4)
    draws = 4000
    for _ in range(draws):
        [index] = sampler.draw(4, 1)
        counts[index] += 1
    frequencies = counts / draws
    # A statistical bound, not a kernel's: over 4000 draws 0.03 is 3.9σ for p = 0.6 and 6.4σ for p = 0.1 (the
    # draws are seeded, so the result is fixed as well).
    assert torch.allclose(frequencies, torch.tensor([0.2, 0.6, 0.1, 0.1]), atol=0.03), frequencies
    assert sampler._drawn.sum() == draws  # every draw is counted by the category it had


def test_a_round_draws_distinct_prompts_and_ranks_split_one_draw():
    sampler = sampler_with_rates([0.5] * 10)
    indices = sampler.draw(10, 10)
    assert sorted(indices) == list(range(10))
    # Two ranks with the same state: disjoint slices of the same draw.
    a, b = sampler_with_rates([0.5] * 10), sampler_with_rates([0.5] * 10)
    mine, theirs = a.draw(10, 4, rank=0, world_size=2), b.draw(10, 4, rank=1, world_size=2)
    assert not set(mine) & set(theirs)


def test_in_band_prompts_dominate_once_rates_are_known():
    # 100 prompts: 10 in the band, 90 always solved; weights 1 vs 0.1 → in-band share 10 / (10 + 9) ≈ 0.53.
    rates = [0.5] * 10 + [1.0] * 90
    sampler = sampler_with_rates(rates)
    drawn = [i for _ in range(400) for i in sampler.draw(100, 1)]
    share = sum(1 for i in drawn if i < 10) / len(drawn)
    assert abs(share - 10 / 19) < 0.08  # 3.2σ of a share over 400 draws (statistical, seeded)


def _rollout(prompts: list[str], solved: list[list[float | None]], rows: list[int] | None = None) -> RolloutBatch:
    """A rollout of ``prompts``' groups whose trajectories' ``exact_answer`` are ``solved``; ``rows``: how many
    rows each trajectory makes (an agent's session may make several), 1 each by default."""
    group = len(solved[0])
    values = [v for row in solved for v in row]
    rows = rows or [1] * len(values)

    def per_row(items):
        return [item for item, count in zip(items, rows) for _ in range(count)]

    n = sum(rows)
    batch = RolloutBatch(
        prompt_ids=torch.ones(n, 1, dtype=torch.long),
        prompt_mask=torch.ones(n, 1, dtype=torch.long),
        completion_ids=torch.ones(n, 1, dtype=torch.long),
        completion_mask=torch.ones(n, 1, dtype=torch.long),
        truncated=torch.zeros(n, dtype=torch.bool),
        rewards=torch.tensor(per_row([v or 0.0 for v in values])),
        prompts=per_row([p for p in prompts for _ in range(group)]),
        reward_columns={"exact_answer": per_row(values)},
    )
    batch.unscorable = torch.tensor(per_row([v is None for v in values]))
    if rows != [1] * len(values):
        batch.trajectory = torch.tensor(per_row(list(range(len(values)))))
    return batch


def test_observe_blends_rates_matches_groups_by_prompt_and_logs():
    texts = ["p0", "p1", "p2", "p3"]
    sampler = CurriculumSampler(CurriculumConfig(history=0.5), seed=0)
    drawn = sampler.draw(4, 3)
    # The rollout's groups come back in another order (dynamic sampling reorders and drops groups).
    order = list(reversed(drawn))
    solved = {drawn[0]: [1, 1, 1, 1], drawn[1]: [1, 0, 0, 0], drawn[2]: [0, 0, 0, 0]}
    rollout = _rollout([texts[i] for i in order], [solved[i] for i in order])
    sampler.observe(rollout, lambda i: texts[i], 4, "exact_answer")
    assert sampler.pass_rates[drawn[0]] == 1.0 and sampler.pass_rates[drawn[1]] == 0.25
    assert sampler.pass_rates[drawn[2]] == 0.0
    assert math.isnan(sampler.pass_rates[({0, 1, 2, 3} - set(drawn)).pop()])
    assert rollout.metrics["curriculum/unseen_fraction"] == 1.0  # all were unseen when drawn
    assert rollout.metrics["curriculum/tracked_prompts"] == 3
    assert all(key.startswith("curriculum/") for key in rollout.metrics)
    # Second observation of a prompt: rate ← 0.5 × old + 0.5 × new.
    sampler._pending = [drawn[1]]
    sampler.observe(_rollout([texts[drawn[1]]], [[1, 1, 1, 1]]), lambda i: texts[i], 4, "exact_answer")
    assert sampler.pass_rates[drawn[1]] == pytest.approx(0.625)


@pytest.mark.parametrize("reward", ["exact_answer", None])  # the accuracy reward's column, or the total
def test_pass_rates_are_over_scored_trajectories_not_rows(reward):
    """An agent's session may make several rows, and a reward may abstain (None): a group's pass rate is the share
    of its trajectories a reward scored that solved it (before: taken over rows, which put one session's rows into
    the next group and matched groups to the wrong prompts; None counted as unsolved; a group no reward scored
    counted as never solved)."""
    texts = ["p0", "p1", "p2"]
    sampler = CurriculumSampler(CurriculumConfig(history=0.5), seed=0)
    drawn = sampler.draw(3, 3)
    solved = {drawn[0]: [1, None, 1, 0], drawn[1]: [0, 1, 1, 1], drawn[2]: [None, None, None, None]}
    rows = [3, 1, 1, 2, 1, 1, 1, 1, 2, 1, 1, 1]  # the first session of each of the first two groups: several rows
    rollout = _rollout([texts[i] for i in drawn], [solved[i] for i in drawn], rows)
    sampler.observe(rollout, lambda i: texts[i], 4, reward)
    assert sampler.pass_rates[drawn[0]].item() == pytest.approx(2 / 3)  # 2 of the 3 scored
    assert sampler.pass_rates[drawn[1]].item() == 0.75
    assert math.isnan(sampler.pass_rates[drawn[2]])  # nothing scored: no rate yet


def test_bad_bounds_are_refused():
    with pytest.raises(ConfigError, match="min_pass_rate"):
        CurriculumConfig(min_pass_rate=0.9, max_pass_rate=0.1)
    with pytest.raises(ConfigError, match="other_weight"):
        CurriculumConfig(other_weight=0.0)


def test_state_is_a_separate_key_of_the_datamodule_state():
    data = RolloutDataModule(curriculum=CurriculumConfig(), seed=3)
    data.curriculum.pass_rates = torch.tensor([0.5, math.nan, 1.0])
    data.curriculum.rounds = 7
    state = data.state_dict()
    assert state["curriculum"]["rounds"] == 7
    restored = RolloutDataModule(curriculum=CurriculumConfig(), seed=3)
    restored.load_state_dict(state)
    assert restored.curriculum.rounds == 7
    assert torch.equal(restored.curriculum.pass_rates.nan_to_num(-1), state["curriculum"]["pass_rates"].nan_to_num(-1))
    assert "curriculum" not in RolloutDataModule().state_dict()


def test_grpo_fit_with_a_curriculum_logs_its_metrics(tmp_path):
    config = {
        "trainer": {
            "accelerator": "cpu",
            "max_epochs": 2,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
        },
        "model": {
            "tiny_model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64},
            "objective": {"beta": 0.0},
        },
        "data": {
            "sampling": {"group_size": 4, "max_new_tokens": 3},
            "prompts_per_round": 4,
            "val_split": None,
            "task_kwargs": {"max_operand": 9, "test_size": 20},
            "curriculum": {"min_pass_rate": 0.1, "max_pass_rate": 0.9},
        },
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(json.loads(json.dumps(config))))
    cli = GRPOCLI(args=["fit", "--config", str(path)])
    metrics = cli.trainer.callback_metrics
    for name in ("preferred", "unseen", "too_easy", "too_hard"):
        assert f"curriculum/{name}_fraction" in metrics
    sampler = cli.datamodule.curriculum
    assert sampler.rounds == 2
    assert metrics["curriculum/tracked_prompts"] == (~sampler.pass_rates.isnan()).sum()
