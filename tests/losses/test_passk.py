"""Pass@k advantages (``data.advantage.estimator: passk``) against hand-computed values of verl's definition.

verl's ``compute_grpo_passk_outcome_advantage`` (``verl/trainer/ppo/core_algos.py``): in each group, the completion
with the highest reward gets r_max − r_second_max (÷ the group's ``torch.std`` + ε, 1e-6 there, with
``norm_adv_by_std_in_grpo``), every other completion 0. That is ours at k = G, with ``std: sample`` and
``eps: 1e-6`` (or ``scale: none`` without the division). A smaller k averages the same rule over every k-subset of
the group; the closed form is checked against that enumeration, subset by subset.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from grpo_lightning.advantages import passk_advantages
from grpo_lightning.config import AdvantageConfig, ConfigError

VERL_EPS = 1e-6


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# Four groups of G = 4: a plain one, a tie at the top, all equal, a tie below the top.
REWARDS = [0.0, 1.0, 0.5, 0.0] + [1.0, 0.0, 1.0, 0.0] + [0.7] * 4 + [2.0, 1.0, 1.0, 0.0]
# Group 1: best is row 1, r_max − r_second_max = 1 − 0.5; mean 0.375, squared deviations 0.140625, 0.390625,
# 0.015625, 0.140625, sample std √(0.6875 / 3). Group 2: the top is tied, 1 − 1 = 0. Group 3: 0.7 − 0.7 = 0.
# Group 4: best is row 12, 2 − 1 = 1; mean 1, deviations (1, 0, 0, −1), sample std √(2 / 3).
RAW = [0.0, 0.5, 0.0, 0.0] + [0.0] * 4 + [0.0] * 4 + [1.0, 0.0, 0.0, 0.0]
STD = [math.sqrt(0.6875 / 3)] * 4 + [1.0] * 8 + [math.sqrt(2 / 3)] * 4  # groups 2, 3: any (their raw values are 0)


def test_k_equal_to_the_group_is_verl():
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    close(passk_advantages(rewards, 4, scale="none"), RAW)
    expected = [raw / (std + VERL_EPS) for raw, std in zip(RAW, STD, strict=True)]
    close(passk_advantages(rewards, 4, scale="group", std="sample", eps=VERL_EPS), expected)
    assert torch.equal(passk_advantages(rewards, 4, k=4), passk_advantages(rewards, 4))  # k = None is G


def test_all_equal_groups_and_ties_at_the_top_are_exactly_zero():
    for k in (2, 3, 4):
        adv = passk_advantages(torch.tensor(REWARDS), 4, k=k, std="sample")
        assert torch.equal(adv[8:12], torch.zeros(4))  # all equal (0.7 is not exact in float32: still 0)
    assert torch.equal(passk_advantages(torch.tensor(REWARDS), 4)[4:8], torch.zeros(4))  # tied best at k = G


@pytest.mark.parametrize(
    "k,expected",
    [
        # r = (3, 1, 2, 0), ranked 3 > 2 > 1 > 0. k = 2: each of the C(4, 2) = 6 pairs gives its better member the
        # difference: 3 gains (1 + 2 + 3) / 6, 2 gains (1 + 2) / 6, 1 gains 1 / 6, 0 nothing.
        (2, [1.0, 1 / 6, 0.5, 0.0]),
        # k = 3: of the 4 triples, {3,1,2}, {3,1,0}, {3,2,0} give 3 the gains 1, 2, 1; {1,2,0} gives 2 the gain 1.
        (3, [4 / 4, 0.0, 1 / 4, 0.0]),
        (4, [1.0, 0.0, 0.0, 0.0]),  # verl: 3 − 2
    ],
)
def test_smaller_k_by_hand(k, expected):
    close(passk_advantages(torch.tensor([3.0, 1.0, 2.0, 0.0], dtype=torch.float64), 4, k=k, scale="none"), expected)


def test_ties_by_hand_at_k_two():
    """(1, 1, 0, 0) at k = 2: the pair of 1s gives 0, each 1 beats each 0 by 1: 2 / C(4, 2) = 1/3 each. Tied
    completions get the same value whichever the sort puts first."""
    close(passk_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), 4, k=2, scale="none"), [1 / 3, 1 / 3, 0.0, 0.0])
    close(passk_advantages(torch.tensor([0.0, 1.0, 0.0, 1.0]), 4, k=2, scale="none"), [0.0, 1 / 3, 0.0, 1 / 3])


def by_enumeration(rewards: list[float], k: int) -> list[float]:
    """The definition: over every k-subset S, the best member gains max(S) − max(S without it); the mean."""
    gains = [0.0] * len(rewards)
    for subset in itertools.combinations(range(len(rewards)), k):
        for i in subset:
            others = max(rewards[j] for j in subset if j != i)
            gains[i] += max(rewards[j] for j in subset) - others
    return [g / math.comb(len(rewards), k) for g in gains]


def test_closed_form_equals_the_enumeration():
    rng = random.Random(0)
    for _ in range(300):
        group_size = rng.randint(2, 8)
        k = rng.randint(2, group_size)
        groups = [[rng.choice([0.0, 0.5, 1.0, 2.0, rng.random()]) for _ in range(group_size)] for _ in range(3)]
        expected = [value for group in groups for value in by_enumeration(group, k)]
        rewards = torch.tensor([value for group in groups for value in group], dtype=torch.float64)
        close(passk_advantages(rewards, group_size, k=k, scale="none"), expected, atol=1e-12)


def test_large_groups_stay_finite():
    """C(64, 32) ≈ 1.8e18: the weights are taken in log space."""
    rewards = torch.arange(64, dtype=torch.float64)
    adv = passk_advantages(rewards, 64, k=32, scale="none")
    assert torch.isfinite(adv).all() and adv[0] == 0 and adv[-1] > adv[-2] > 0
    # 63 is in half the subsets, and beats the best of the other 31 (drawn from 0..62, 61 on average) by 2 on
    # average: 1. Rank by rank: second best 64 - q, C(64 - q, 30) subsets each.
    expected = sum(math.comb(64 - q, 30) * (q - 1) for q in range(2, 65)) / math.comb(64, 32)
    assert expected == pytest.approx(1.0, rel=1e-15)
    assert adv[-1].item() == pytest.approx(expected, rel=1e-12)


def test_unscorable_completions_are_left_out():
    """(−, 1, 1, 0) with row 0 unscorable: n = 3. At k = 2 each 1 beats the 0: 1 / C(3, 2). At k = 4 > n the
    group's 3 scorable completions are the attempt, and its tied top gives 0. The unscorable row gets 0."""
    rewards, scorable = torch.tensor([9.0, 1.0, 1.0, 0.0]), torch.tensor([False, True, True, True])
    close(passk_advantages(rewards, 4, k=2, scale="none", scorable=scorable), [0.0, 1 / 3, 1 / 3, 0.0])
    close(passk_advantages(rewards, 4, k=4, scale="none", scorable=scorable), [0.0] * 4)
    # The group std is that of the scorable ones: (1, 1, 0), population std √2 / 3.
    close(
        passk_advantages(rewards, 4, k=2, scorable=scorable, eps=1e-12),
        [0.0, 1 / 3 / (math.sqrt(2) / 3), 1 / 3 / (math.sqrt(2) / 3), 0.0],
    )


def test_batch_scale():
    rewards = torch.tensor(REWARDS)
    batch_std = torch.tensor(2.0)
    close(passk_advantages(rewards, 4, scale="batch", batch_std=batch_std), [r / (2.0 + 1e-4) for r in RAW])
    close(passk_advantages(rewards, 4, scale="batch", std="sample"), [r / (rewards.std() + 1e-4) for r in RAW])
    with pytest.raises(ValueError, match="batch_std"):
        passk_advantages(rewards, 4, scale="group", batch_std=batch_std)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="k must be between 2 and group_size=4"):
        passk_advantages(torch.zeros(8), 4, k=5)
    with pytest.raises(ValueError, match="k must be between 2"):
        passk_advantages(torch.zeros(8), 4, k=1)
    with pytest.raises(ValueError, match="scale"):
        passk_advantages(torch.zeros(8), 4, scale="bogus")


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"estimator": "passk", "k": 1}, r"data.advantage.k must be an integer >= 2 \(got 1\)"),
        ({"estimator": "passk", "k": 0}, r"data.advantage.k must be an integer >= 2 \(got 0\)"),
        ({"k": 4}, "data.advantage.k is read by estimator: passk only"),
        ({"estimator": "passk", "baseline": "rloo"}, "baseline: rloo does not apply to estimator: passk"),
        ({"estimator": "pass_at_k"}, "data.advantage.estimator must be grpo or passk"),
    ],
)
def test_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(ConfigError, match=message) as error:
        AdvantageConfig(**settings)
    assert "\n" not in str(error.value)


def test_k_up_to_the_group_size():
    AdvantageConfig(estimator="passk", k=8).check_round(8, process_rewards=False)
    AdvantageConfig(estimator="passk").check_round(8, process_rewards=False)
    with pytest.raises(ConfigError, match=r"data.advantage.k must be at most data.sampling.group_size=8 \(got 9\)"):
        AdvantageConfig(estimator="passk", k=9).check_round(8, process_rewards=False)
