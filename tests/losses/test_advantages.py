"""Tests for the advantages of grpo_lightning.advantages (group and process). Expected values are derived by hand."""

import math

import pytest
import torch

from grpo_lightning.advantages import group_advantages, process_advantages

EPS = 1e-4


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-6)


# ----------------------------------------------------------------------------- group_advantages

# Two groups of G=3. Group 1: mean 3, deviations (-2, -1, 3), population var 14/3.
# Group 2: mean 1, deviations (-1, -1, 2), population var 2. All six: mean 2, var 26/6.
REWARDS = [1.0, 2.0, 6.0, 0.0, 0.0, 3.0]
DEV = [-2.0, -1.0, 3.0, -1.0, -1.0, 2.0]
# RLOO: r_i - mean(others), e.g. 1 - (2 + 6) / 2 = -3.
RLOO = [-3.0, -1.5, 4.5, -1.5, -1.5, 3.0]
GROUP_STD = [math.sqrt(14 / 3)] * 3 + [math.sqrt(2)] * 3
BATCH_STD = math.sqrt(26 / 6)


@pytest.mark.parametrize(
    "baseline,scale,expected",
    [
        ("mean", "none", DEV),
        ("mean", "group", [d / (s + EPS) for d, s in zip(DEV, GROUP_STD, strict=True)]),
        ("mean", "batch", [d / (BATCH_STD + EPS) for d in DEV]),
        ("rloo", "none", RLOO),
        ("rloo", "group", [d / (s + EPS) for d, s in zip(RLOO, GROUP_STD, strict=True)]),
        ("rloo", "batch", [d / (BATCH_STD + EPS) for d in RLOO]),
    ],
)
def test_group_advantages_values(baseline, scale, expected):
    adv = group_advantages(t(REWARDS), 3, baseline=baseline, scale=scale)
    close(adv, expected)


@pytest.mark.parametrize("baseline", ["mean", "rloo"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_all_equal_group_is_exactly_zero(baseline, scale):
    adv = group_advantages(torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7]), 3, baseline=baseline, scale=scale)
    assert not torch.isnan(adv).any()
    assert torch.equal(adv, torch.zeros(6))
    # One constant group next to a varying one: the constant group is still exactly 0.
    adv = group_advantages(torch.tensor([0.3, 0.3, 0.0, 1.0]), 2, baseline=baseline, scale=scale)
    assert torch.equal(adv[:2], torch.zeros(2))


def test_group_advantages_group_size_two():
    # Group (1, 0): mean 0.5, std 0.5; RLOO: 1 - 0 = 1 and 0 - 1 = -1. Group (0, 0) is constant.
    r = t([1.0, 0.0, 0.0, 0.0])
    close(group_advantages(r, 2), [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS), 0.0, 0.0])
    close(group_advantages(r, 2, baseline="rloo", scale="none"), [1.0, -1.0, 0.0, 0.0])


def test_group_advantages_sample_std():
    """``std="sample"`` divides the variance by G - 1 (TRL, verl): at G = 4, 1/0/0/0 has population std
    sqrt(3)/4 and sample std 1/2."""
    rewards = t([1.0, 0.0, 0.0, 0.0])
    sample = group_advantages(rewards, 4, std="sample", eps=1e-12)
    population = group_advantages(rewards, 4, std="population", eps=1e-12)
    close(sample, [1.5, -0.5, -0.5, -0.5])
    close(
        population,
        [0.75 / (math.sqrt(3) / 4), -0.25 / (math.sqrt(3) / 4), -0.25 / (math.sqrt(3) / 4), -0.25 / (math.sqrt(3) / 4)],
    )
    close(population / sample, [math.sqrt(4 / 3)] * 4)  # the 1.155x of the issue
    # batch scale: the std of all rewards, with the same choice
    close(group_advantages(rewards, 4, scale="batch", std="sample", eps=1e-12), [1.5, -0.5, -0.5, -0.5])
    with pytest.raises(ValueError, match="std"):
        group_advantages(rewards, 4, std="bessel")


def test_process_advantages_sample_std():
    # One group of 2 rows with one step each: rewards 1 and 0 -> mean 0.5, sample std sqrt(0.5), population 0.5.
    steps, ends, mask = t([[1.0], [0.0]]), torch.tensor([[1], [1]]), torch.ones(2, 2)
    sample = process_advantages(steps, ends, mask, 2, std="sample", eps=1e-12)
    close(sample, [[0.5 / math.sqrt(0.5)] * 2, [-0.5 / math.sqrt(0.5)] * 2])
    population = process_advantages(steps, ends, mask, 2, eps=1e-12)
    close(population, [[1.0, 1.0], [-1.0, -1.0]])


def test_group_advantages_batch_std_override():
    adv = group_advantages(t([1.0, 0.0, 0.0, 0.0]), 2, scale="batch", batch_std=t(2.0))
    close(adv, [0.5 / (2 + EPS), -0.5 / (2 + EPS), 0.0, 0.0])


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="divisible"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.zeros(4), 2, scale="nope")
    with pytest.raises(ValueError, match="baseline"):
        group_advantages(torch.zeros(4), 2, baseline="nope")
    with pytest.raises(ValueError, match="batch_std"):
        group_advantages(torch.zeros(4), 2, batch_std=t(1.0))


# ----------------------------------------------------------------------------- process_advantages


def test_process_advantages_hand_example():
    nan = float("nan")
    # Group A (rows 0, 1): valid step rewards {1, 0, 1}: mean 2/3, population var 2/9 -> std sqrt(2)/3.
    # Group B (rows 2, 3): every step reward is 0.5 -> all zero.
    step_rewards = t([[1.0, 0.0], [1.0, nan], [0.5, 0.5], [0.5, nan]])
    step_ends = torch.tensor([[1, 4], [2, -1], [0, 3], [4, -1]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    std = math.sqrt(2) / 3
    a = (1 - 2 / 3) / (std + EPS)  # step reward 1
    b = (0 - 2 / 3) / (std + EPS)  # step reward 0
    expected = [
        [a + b, a + b, b, b, b],  # tokens 0-1 are before both step ends, tokens 2-4 only before the 2nd
        [a, a, a, 0.0, 0.0],  # one step ending at token 2; tokens 3-4 are padding
        [0.0] * 5,
        [0.0] * 5,
    ]
    adv = process_advantages(step_rewards, step_ends, mask, 2)
    close(adv, expected)


def test_process_advantages_errors():
    with pytest.raises(ValueError, match="divisible"):
        process_advantages(torch.zeros(3, 2), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 4), 2)
    with pytest.raises(ValueError, match="step_ends"):
        process_advantages(torch.zeros(2, 2), torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 4), 2)
