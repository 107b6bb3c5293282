"""Dynamic sampling asks the advantages' own question: does this group carry a signal (is one of its advantages
not 0)? One function answers it for the filter (``refill_informative``), ``rollout/filtered_fraction`` and
``rollout/zero_std_group_fraction``, whatever makes the advantages: rewards that abstain (None), GDPO's per-column
normalisation, pass@k's ties at the top, process rewards.

A scripted engine gives every prompt's group the same texts, chosen per test; 8 prompts of G = 4 a draw.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import step_length_reward
from test_multiturn import EOS, ScriptedEngine

from grpo_lightning.config import AdvantageConfig, SamplingConfig
from grpo_lightning.models.tiny import build_char_tokenizer
from grpo_lightning.rewards import RewardSpec, register
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.prompts import PromptEncoder
from grpo_lightning.rollout.round import RoundSettings, finish_round, informative_groups, sample_round

PROMPTS, GROUP, CAP = 8, 4, 3


@register("test_signal_none_or_one")
def none_or_one(prompts, completions, **_):
    """Not applicable to ``x``, 1 for anything else."""
    return [None if c == "x" else 1.0 for c in completions]


@register("test_signal_p")
def is_p(prompts, completions, **_):
    return [float(c == "p") for c in completions]


@register("test_signal_half_q")
def half_q(prompts, completions, **_):
    return [0.5 * (c == "q") for c in completions]


register("test_signal_steps")(step_length_reward)


def dynamic_round(texts, rewards, **advantage):
    """One round with ``data.sampling.dynamic_sampling`` (at most ``CAP`` draws): the finished rollout."""
    tokenizer = build_char_tokenizer()
    answers = itertools.cycle(texts)
    engine = ScriptedEngine(tokenizer, lambda context: next(answers) + EOS)
    prompts = itertools.count()
    settings = RoundSettings(
        sampling=SamplingConfig(group_size=GROUP, max_new_tokens=8),
        advantage=AdvantageConfig(**advantage),
        optimizer_steps=1,
        reference=False,
        dynamic_sampling=True,
        max_sampling_rounds=CAP,
    )
    sampled = sample_round(
        lambda: {"prompt": [f"{next(prompts)}=" for _ in range(PROMPTS)]},
        engine=engine,
        encoder=PromptEncoder(tokenizer),
        scorer=Scorer([RewardSpec(name, weight=w) for name, w in rewards]),
        settings=settings,
        generator=torch.Generator().manual_seed(0),
    )
    return finish_round(sampled, logprobs=lambda b, old, ref: (None, None), settings=settings)


def signal(rollout):
    """[groups] whether any advantage of the group is not 0."""
    return rollout.advantages.reshape(PROMPTS, -1).ne(0).any(-1)


def test_a_group_whose_only_spread_is_an_abstention_carries_no_signal():
    """Issue 56 item 1: [None, 1, 1, 1] in every group: every advantage is 0, so every draw is filtered out up to
    the cap and the metrics say so (before: the totals [0, 1, 1, 1] differ, so the groups were kept as informative,
    one draw, filtered fraction 0, though no kept group had a non-zero advantage)."""
    rollout = dynamic_round(["x", "a", "a", "a"], [("test_signal_none_or_one", 1.0)])
    assert not signal(rollout).any()
    assert rollout.metrics["rollout/sampling_rounds"] == CAP
    assert rollout.metrics["rollout/filtered_fraction"] == rollout.metrics["rollout/zero_std_group_fraction"] == 1.0


def test_gdpo_groups_with_equal_totals_but_a_signal_are_kept():
    """Issue 56 item 2: a = [1, 0, 1, 0] (weight 1), b = [0, .5, 0, .5] (weight 2): equal totals, but GDPO's
    advantages are ±1: kept at the first draw (before: dropped, zero-std fraction 1)."""
    rewards = [("test_signal_p", 1.0), ("test_signal_half_q", 2.0)]
    rollout = dynamic_round(["p", "q", "p", "q"], rewards, multi_objective_aggregation="normalize_then_sum")
    assert rollout.rewards.unique().tolist() == [1.0] and signal(rollout).all()
    assert rollout.metrics["rollout/sampling_rounds"] == 1
    assert rollout.metrics["rollout/filtered_fraction"] == rollout.metrics["rollout/zero_std_group_fraction"] == 0.0


def test_pass_at_g_with_a_tie_at_the_top_carries_no_signal():
    """pass@k at k = G: the group's best gains r_max − r_second_max, 0 for a tie at the top; a group [1, 1, 0, 0]
    has every advantage 0, and is filtered as such (before: kept, its totals differ)."""
    rollout = dynamic_round(["p", "p", "q", "q"], [("test_signal_p", 1.0)], estimator="passk")
    assert not signal(rollout).any() and rollout.metrics["rollout/sampling_rounds"] == CAP
    assert rollout.metrics["rollout/zero_std_group_fraction"] == 1.0


def test_process_rewards_that_differ_are_a_signal():
    """Process rewards alone (no outcome total): steps of different lengths give per-token advantages, so the
    groups are kept at the first draw (before: the totals, all 0, made every group look uninformative)."""
    rollout = dynamic_round(["ab1c", "a1b", "abc", "a"], [("test_signal_steps", 1.0)])
    assert signal(rollout).all() and rollout.metrics["rollout/sampling_rounds"] == 1
    assert rollout.metrics["rollout/zero_std_group_fraction"] == 0.0


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_groups_with_a_signal_are_kept_and_counted(aggregation):
    """The ordinary case is unchanged: rewards that differ are kept at the first draw."""
    rollout = dynamic_round(["p", "q", "q", "q"], [("test_signal_p", 1.0)], multi_objective_aggregation=aggregation)
    assert signal(rollout).all() and rollout.metrics["rollout/sampling_rounds"] == 1
    assert rollout.metrics["rollout/filtered_fraction"] == 0.0


def test_a_failed_agent_session_leaves_its_group_without_a_signal():
    """``on_error: skip``: a failed session is unscorable (out of every column), so a group [failed, 1, 1, 1] of
    sessions carries no signal, whatever its rows (before: its total 0 made the group look informative)."""
    from test_agent_gateway import sessions_batch

    batch = sessions_batch([1, 2, 1, 1], [0.0, 1.0, 1.0, 1.0])  # the second session made two rows
    batch.reward_columns = {"agent": [None, 1.0, 1.0, 1.0, 1.0]}
    batch.unscorable = torch.tensor([True, False, False, False, False])
    settings = RoundSettings(sampling=SamplingConfig(group_size=4), advantage=AdvantageConfig(), optimizer_steps=1)
    assert informative_groups(batch, settings).tolist() == [False]
    batch.reward_columns["agent"][0], batch.unscorable[0] = 0.0, False  # scored 0: now it differs
    assert informative_groups(batch, settings).tolist() == [True]
