"""GDPO (``data.advantage.multi_objective_aggregation: normalize_then_sum``) against TRL 1.16 and by hand.

TRL's advantages are computed inside ``GRPOTrainer._generate_and_score_completions``, so the cross-check runs that
method as it is, on a real ``GRPOTrainer`` over the tiny model built in code: ``_generate`` is replaced by one that
returns fixed completions (TRL's generation is not under test), and the reward functions, which both sides call,
return fixed values per dataset row (``None`` included, which TRL turns into NaN). Ours go through the same
``Scorer`` and ``compute_advantages`` a round uses, with ``data.advantage.std: sample`` (TRL's std) and TRL's
eps (1e-4, ours by default). Both aggregations must agree to 1e-6.

One difference, on purpose, not in the cross-check: where a reward is constant within a group, TRL's float32
``x - nanmean(x)`` can leave a rounding residue (0.3 six times: 3e-4 after the division by 0 + 1e-4); ours gives
exactly 0 there (``test_a_constant_reward_adds_exactly_zero``).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY

from grpo_lightning.advantages import batch_normalized, decoupled_sum, group_advantages
from grpo_lightning.config import AdvantageConfig, SamplingConfig
from grpo_lightning.models.tiny import build_char_tokenizer, build_tiny_llama
from grpo_lightning.rewards import RewardSpec, register
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.round import RoundSettings, compute_advantages

trl = pytest.importorskip("trl", reason="trl (a dev dependency) is not installed")

VALUES: dict[str, list[float | None]] = {}  # what each reward returns for dataset row i, set by each case
NAMES = ("gdpo_a", "gdpo_b", "gdpo_c")


def _fixed(name: str):
    def reward(prompts, completions, row, **_):
        return [VALUES[name][i] for i in row]

    reward.__name__ = name  # TRL names a reward function by its __name__
    return register(name)(reward)


REWARDS = {name: _fixed(name) for name in NAMES}

# Each case: the rewards' values per completion (groups of G adjacent) and their weights.
CASES = {
    # G = 4, three rewards: a None here and there, a row no reward applies to (row 7), a reward constant in a
    # group (gdpo_a in group 2), a reward that applies to one completion only of a group (gdpo_c in group 1).
    "none_rewards": (
        4,
        {
            "gdpo_a": [1.0, None, 0.0, 1.0, 0.5, 0.5, None, None],
            "gdpo_b": [0.2, 0.3, None, 0.1, 0.0, 0.25, 1.0, None],
            "gdpo_c": [None, None, 2.0, None, 3.0, 1.0, 0.0, None],
        },
        [1.0, 2.0, 0.5],
    ),
    # G = 3, two rewards: group 2 has every reward constant (all its advantages 0), group 3 one reward constant.
    "all_equal_groups": (
        3,
        {
            "gdpo_a": [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5],
            "gdpo_b": [0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 2.0, 0.0, 1.0],
        },
        [1.0, 1.0],
    ),
    # G = 2: one reward, and a whole group of unscorable completions.
    "one_reward": (2, {"gdpo_a": [3.0, 1.0, None, None, 0.0, 2.0, 5.0, 5.0]}, [1.5]),
}


def trl_advantages(group_size: int, values: dict, weights: list[float], aggregation: str) -> torch.Tensor:
    """TRL 1.16's advantages for completions scored ``values`` (``_generate_and_score_completions``, unchanged)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    VALUES.clear()
    VALUES.update(values)
    n = len(next(iter(values.values())))
    tokenizer = build_char_tokenizer()
    args = GRPOConfig(
        output_dir="unused",
        use_cpu=True,
        per_device_train_batch_size=n,
        num_generations=group_size,
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        max_completion_length=4,
        beta=0.0,  # no reference pass: nothing else runs a model
        reward_weights=weights,
        multi_objective_aggregation=aggregation,
        report_to="none",
        save_strategy="no",
    )
    rows = Dataset.from_dict({"prompt": ["1+1="] * n, "row": list(range(n))})
    trainer = GRPOTrainer(
        model=build_tiny_llama(TINY, tokenizer),
        reward_funcs=[REWARDS[name] for name in values],
        args=args,
        train_dataset=rows,
        processing_class=tokenizer,
    )
    trainer.model.train()  # TRL groups by num_generations in train mode

    def fixed_generation(prompts):  # TRL's _generate's return: ids, completions, no tool mask / logprobs / images
        prompt_ids = [tokenizer("1+1=")["input_ids"] for _ in prompts]
        completion_ids = [[5, 6, tokenizer.eos_token_id] for _ in prompts]
        return prompt_ids, completion_ids, None, ["22"] * len(prompts), None, {}, None, None

    trainer._generate = fixed_generation
    inputs = [{"prompt": "1+1=", "row": i} for i in range(n)]
    return trainer._generate_and_score_completions(inputs)["advantages"]


def scored_batch(values: dict, weights: list[float]) -> SimpleNamespace:
    """What ``sample_and_score`` keeps of the scores: the rows our ``Scorer`` gives these rewards."""
    VALUES.clear()
    VALUES.update(values)
    n = len(next(iter(values.values())))
    scorer = Scorer([RewardSpec(name, weight=w) for name, w in zip(values, weights, strict=True)])
    scores = scorer(["1+1="] * n, ["22"] * n, {"row": list(range(n))})
    return SimpleNamespace(
        rewards=torch.tensor(scores.total),
        reward_columns=scores.per_function,
        reward_weights=scores.weights,
        unscorable=torch.tensor(scores.unscorable),
        step_rewards=None,
    )


def ours(values: dict, weights: list[float], group_size: int, aggregation: str, **advantage) -> torch.Tensor:
    settings = RoundSettings(
        sampling=SamplingConfig(group_size=group_size),
        advantage=AdvantageConfig(multi_objective_aggregation=aggregation, **advantage),
        optimizer_steps=1,
    )
    return compute_advantages(scored_batch(values, weights), settings)


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_advantages_equal_trl(case, aggregation):
    group_size, values, weights = CASES[case]
    expected = trl_advantages(group_size, values, weights, aggregation)
    actual = ours(values, weights, group_size, aggregation, std="sample")
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=0)
    assert expected.abs().max() > 0.1  # the cases have signal: the check is not of zeros against zeros


def test_hand_computed_two_rewards():
    """G = 2, rewards r1, r2 with weights 1, 2; population std, eps 1e-12 (so z = 0.5 / 0.5 = 1).

    Group 1: r1 = (1, 0) → (+1, −1), r2 = (0, 1) → (−1, +1); A_sum = (1 − 2, −1 + 2) = (−1, 1).
    Group 2: r1 = (1, 1) constant → 0, r2 = (1, 0) → (+1, −1); A_sum = (2, −2).
    Batch: mean 0, population std √((1 + 1 + 4 + 4) / 4) = √2.5, so A = A_sum / √2.5.
    GRPO's sum (totals (1, 2) and (3, 1)) gives both groups (−1, 1) and (1, −1): the weight of r2 is lost.
    """
    values = {"gdpo_a": [1.0, 0.0, 1.0, 1.0], "gdpo_b": [0.0, 1.0, 1.0, 0.0]}
    gdpo = ours(values, [1.0, 2.0], 2, "normalize_then_sum", eps=1e-12)
    torch.testing.assert_close(gdpo, torch.tensor([-1.0, 1.0, 2.0, -2.0]) / math.sqrt(2.5), atol=1e-6, rtol=0)
    grpo = ours(values, [1.0, 2.0], 2, "sum_then_normalize", eps=1e-12)
    torch.testing.assert_close(grpo, torch.tensor([-1.0, 1.0, 1.0, -1.0]), atol=1e-6, rtol=0)


def test_hand_computed_none_and_sample_std():
    """One group of 3, sample std, eps 1e-12. r1 = (1, None, 0): mean 0.5 and sample std √0.5 over the two it
    applies to → (0.5/√0.5, 0, −0.5/√0.5). r2 = (2, 2, 5): mean 3, sample std √3 → (−1/√3, −1/√3, 2/√3).
    A_sum is their sum (weights 1); its batch mean is 0 and its sample std √(Σ A_sum² / 2)."""
    a, b = 0.5 / math.sqrt(0.5), 1 / math.sqrt(3)
    summed = [a - b, -b, -a + 2 * b]
    spread = math.sqrt(sum(x * x for x in summed) / 2)
    actual = ours(
        {"gdpo_a": [1.0, None, 0.0], "gdpo_b": [2.0, 2.0, 5.0]},
        [1.0, 1.0],
        3,
        "normalize_then_sum",
        eps=1e-12,
        std="sample",
    )
    torch.testing.assert_close(actual, torch.tensor([x / spread for x in summed]), atol=1e-6, rtol=0)


def test_one_reward():
    """With one reward, ``sum_then_normalize`` is today's advantage exactly; ``normalize_then_sum`` is that advantage
    normalised again over the batch (GDPO's second step, as in TRL), so not today's: with the population std every
    informative group's advantages have std ≈ 1 and a constant group's are 0, so the batch's std is about
    √(share of informative groups), and GDPO's advantages are today's divided by it (equal, to O(eps), when every
    group is informative)."""
    rewards = [3.0, 1.0, 0.0, 2.0, 0.0, 0.0, 1.0, 4.0]  # group 3 constant: 3 of 4 groups informative
    today = group_advantages(torch.tensor(rewards), 2)
    assert torch.equal(ours({"gdpo_a": rewards}, [1.0], 2, "sum_then_normalize"), today)
    gdpo = ours({"gdpo_a": rewards}, [1.0], 2, "normalize_then_sum")
    torch.testing.assert_close(gdpo, batch_normalized(today), atol=1e-6, rtol=0)
    torch.testing.assert_close(gdpo, today * math.sqrt(4 / 3), atol=1e-3, rtol=0)
    informative = [3.0, 1.0, 0.0, 2.0, 1.0, 4.0]
    today = group_advantages(torch.tensor(informative), 2)
    torch.testing.assert_close(ours({"gdpo_a": informative}, [1.0], 2, "normalize_then_sum"), today, atol=1e-3, rtol=0)


def test_a_constant_reward_adds_exactly_zero():
    """0.3 six times is not exactly its float32 mean: TRL leaves ~3e-4 there, ours exactly 0 (module docstring)."""
    rewards = torch.tensor([[0.3, 0.0], [0.3, 1.0], [0.3, 0.0], [0.3, 1.0], [0.3, 1.0], [0.3, 0.0]] + [[0.3, 0.3]] * 6)
    summed = decoupled_sum(rewards, torch.tensor([5.0, 1.0]), 6)
    expected = decoupled_sum(rewards[:, 1:], torch.tensor([1.0]), 6)  # the constant reward adds nothing
    assert torch.equal(summed, expected)
    assert torch.equal(summed[6:], torch.zeros(6))  # every reward constant: exactly 0, and so is the advantage
    assert torch.equal(batch_normalized(summed)[6:], torch.zeros(6))


def test_unscorable_rows_are_out_of_the_batch():
    """A row no reward applies to is NaN in the sum, out of the batch's mean and std, and gets advantage 0."""
    rewards = torch.tensor([[1.0], [0.0], [float("nan")], [float("nan")]])
    summed = decoupled_sum(rewards, torch.tensor([1.0]), 2, eps=1e-12)
    assert summed[:2].tolist() == [1.0, -1.0] and summed[2:].isnan().all()
    torch.testing.assert_close(batch_normalized(summed, eps=1e-12), torch.tensor([1.0, -1.0, 0.0, 0.0]))


@pytest.mark.parametrize("std", ["population", "sample"])
def test_the_batch_is_every_rank(std):
    """Two ranks, each with its own groups: each normalises its sums by the mean and std of both ranks' sums (what
    ``compute_advantages`` gathers), which is the one-process result on all rows."""
    torch.manual_seed(0)
    rewards = torch.rand(16, 3).round(decimals=1)
    rewards[3, 1] = rewards[9, 0] = float("nan")
    weights = torch.tensor([1.0, 0.5, 2.0])
    whole = batch_normalized(decoupled_sum(rewards, weights, 4, std=std), std=std)
    ranks = [decoupled_sum(part, weights, 4, std=std) for part in rewards.split(8)]
    gathered = torch.cat(ranks)
    per_rank = torch.cat([batch_normalized(summed, std=std, batch=gathered) for summed in ranks])
    torch.testing.assert_close(per_rank, whole, atol=1e-6, rtol=0)
    local = batch_normalized(ranks[0], std=std)  # without the other rank the batch is another one
    assert not torch.allclose(local, whole[:8], atol=1e-3)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="weights"):
        decoupled_sum(torch.zeros(4, 2), torch.ones(3), 2)
    with pytest.raises(ValueError, match="divisible"):
        decoupled_sum(torch.zeros(5, 2), torch.ones(2), 2)
    with pytest.raises(ValueError, match="std"):
        batch_normalized(torch.zeros(4), std="bessel")
