"""pass@k against its closed form and brute force, maj@k ties, and sum-state reduction across (simulated) ranks."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from grpo_lightning.config import ConfigError, EvalConfig
from grpo_lightning.metrics import MajorityAtK, PassAtK, majority_vote, pass_at_k, resolve_answer_fn


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Share of the k-subsets of n samples (the first c correct) holding at least one correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("k", [1, 5])
@pytest.mark.parametrize("c", range(11))
def test_pass_at_k_closed_form_and_brute_force(c, k):
    n = 10
    closed = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(closed, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_edge_cases_and_stability():
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 6, 5) == 1.0  # n − c < k: every 5-subset holds a correct sample
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the fraction correct
    # C(2000, 500) ≈ 1e486 overflows a float; the product form needs no binomial coefficient.
    n, c, k = 2000, 7, 500
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)  # Python ints: exact up to the final division
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-9)
    with pytest.raises(ValueError):
        pass_at_k(10, 11, 1)
    with pytest.raises(ValueError):
        pass_at_k(10, 1, 11)


def test_pass_at_k_metric_is_the_mean_over_prompts():
    metric = PassAtK(5)
    metric.update(torch.tensor([0, 3]), 10)
    metric.update([10], 10)
    expected = (pass_at_k(10, 0, 5) + pass_at_k(10, 3, 5) + 1.0) / 3
    assert metric.compute().item() == pytest.approx(expected, abs=1e-6)


def test_majority_vote_ties_go_to_the_earliest_sampled_answer():
    assert majority_vote(["b", "a", "a", "c"]) == 1  # clear majority: its first sample
    assert majority_vote(["a", "b", "b", "a"]) == 0  # 2–2 tie: "a" was sampled first
    assert majority_vote(["b", "a", "a", "b"]) == 0  # 2–2 tie: "b" was sampled first
    assert majority_vote(["c", "a", "b", "b", "a"]) == 1  # a and b tie at 2; "a" appears first (index 1)
    assert majority_vote([None, "x", None]) == 1  # None abstains
    assert majority_vote([None, None]) is None


def test_majority_metric_uses_the_winner_correctness():
    metric = MajorityAtK()
    answers = [
        ["4", "5", "5", "4"],  # tie, "4" first → its sample 0 (correct)
        ["5", "4", "4", "5"],  # tie, "5" first → its sample 0 (wrong)
        ["7", "8", "8", "8"],  # majority "8" (correct)
        [None, None, None, None],  # no answer: unsolved
    ]
    correct = [[True, False, False, True], [False, True, True, False], [False, True, True, True], [False] * 4]
    metric.update(answers, correct)
    assert metric.compute().item() == pytest.approx(2 / 4)


def _gather_from(world: list[torch.nn.Module]):
    """A stand-in for all_gather: the same state of every simulated rank, found by identity."""

    def gather(tensor, group=None):
        for metric in world:
            for name in metric._reductions:
                if getattr(metric, name) is tensor:
                    return [getattr(rank, name) for rank in world]
        raise AssertionError("unknown state")

    return gather


def test_metrics_reduce_by_summing_states_across_ranks():
    world: list[torch.nn.Module] = []  # the simulated ranks; filled below, read by the gather at compute time
    options = {"dist_sync_fn": _gather_from(world), "distributed_available_fn": lambda: True}
    ranks = [PassAtK(2, **options), PassAtK(2, **options)]
    world.extend(ranks)
    # Unequal shards: rank 0 has one prompt, rank 1 three; a mean of per-rank means would be wrong.
    ranks[0].update([4], 4)
    ranks[1].update([0, 0, 1], 4)
    expected = (1.0 + 0.0 + 0.0 + pass_at_k(4, 1, 2)) / 4
    assert ranks[0].compute().item() == pytest.approx(expected, abs=1e-6)
    assert ranks[1].compute().item() == pytest.approx(expected, abs=1e-6)
    assert ranks[0].count.item() == 1  # local states are restored after the synced compute

    majority = [MajorityAtK(**options), MajorityAtK(**options)]
    world[:] = majority
    majority[0].update([["a", "a", "b"]], [[True, True, False]])
    majority[1].update([["a", "b", "b"], ["x", "y", "z"]], [[True, False, False], [False, False, True]])
    assert majority[0].compute().item() == pytest.approx(1 / 3)


def test_eval_settings_are_checked():
    assert EvalConfig(0, 1.0, None).ks == []
    assert EvalConfig(8, 1.0, None).ks == [1, 8]
    assert EvalConfig(10, 0.7, [5, 1, 5]).ks == [1, 5]
    for num_samples, pass_k, temperature in [
        (-1, None, 1.0),
        (4, [8], 1.0),
        (4, [0], 1.0),
        (0, [1], 1.0),
        (4, None, 0.0),
    ]:
        with pytest.raises(ConfigError, match="data.eval"):
            EvalConfig(num_samples, temperature, pass_k)
    assert resolve_answer_fn(None)("  42 \n") == "42"
    assert resolve_answer_fn("grpo_lightning.rewards.math.extract_answer")("so \\boxed{7}") == "7"
    with pytest.raises(ConfigError, match="no_such"):
        resolve_answer_fn("grpo_lightning.no_such.fn")
