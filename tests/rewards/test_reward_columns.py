"""One rule for every source of reward (``rewards/combine.py: combine_columns``, ``Scorer``'s ``parts``): each
source is a column of one value per completion, None where it does not apply; the total is the weighted sum of the
values (None left out, TRL's ``nansum``), and a completion is unscorable only when no column gives it a value."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from helpers import step_length_reward
from test_multiturn import EOS, ScriptedEngine

from grpo_lightning.advantages import process_advantages
from grpo_lightning.config import AdvantageConfig, SamplingConfig
from grpo_lightning.engines.base import SamplingParams
from grpo_lightning.models.tiny import build_char_tokenizer
from grpo_lightning.rewards import RewardSpec, register
from grpo_lightning.rewards.combine import combine_columns
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.prompts import PromptEncoder
from grpo_lightning.rollout.round import RoundSettings, compute_advantages
from grpo_lightning.rollout.sample_and_score import sample_and_score


@register("test_columns_none_for_z")
def none_for_z(prompts, completions, **_):
    return [None if c.startswith("z") else float(len(c)) for c in completions]


register("test_columns_steps")(step_length_reward)


def test_the_rule():
    columns = {"a": [1.0, None, None], "b": [None, 2.0, None]}
    total, unscorable = combine_columns(columns, {"a": 3.0}, 3)  # b not named: weight 1
    assert total == [3.0, 2.0, 0.0] and unscorable == [False, False, True]
    assert combine_columns({}, {}, 2) == ([0.0, 0.0], [True, True])  # no column at all: nothing scores them
    with pytest.raises(ValueError, match="'a' has 1 values for 3 rows"):
        combine_columns({"a": [1.0]}, {}, 3)


def test_other_sources_join_the_functions_columns_under_the_same_rule(caplog):
    """An environment's or an agent's parts: columns with their weights; a completion the functions abstain on but
    a part scores is scorable; one left out (a failed agent session) is None everywhere, without a warning."""
    scorer = Scorer([RewardSpec("test_columns_none_for_z", weight=2.0)])
    parts = {"env_judge": [None, 1.0, None, 0.5]}
    with caplog.at_level(logging.WARNING, logger="grpo_lightning.rewards.scorer"):
        scores = scorer(["p"] * 4, ["ab", "z", "z", "abc"], {}, parts=parts, part_weights={"env_judge": 10.0})
    assert scores.per_function == {"test_columns_none_for_z": [2.0, None, None, 3.0], "env_judge": parts["env_judge"]}
    assert scores.weights == {"test_columns_none_for_z": 2.0, "env_judge": 10.0}
    assert scores.total == [4.0, 10.0, 0.0, 11.0] and scores.unscorable == [False, False, True, False]
    assert len(caplog.records) == 1 and "1 of 4 completions have no applicable reward" in caplog.records[0].message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpo_lightning.rewards.scorer"):
        left = scorer(["p"] * 4, ["ab", "z", "z", "abc"], {}, parts=parts, left_out=[True, False, True, False])
    assert left.per_function["test_columns_none_for_z"][0] is None and left.per_function["env_judge"][2] is None
    assert left.unscorable == [True, False, True, False] and left.total == [0.0, 1.0, 0.0, 6.5]
    assert not caplog.records  # the left-out ones are expected, and every other one is scored
    with pytest.raises(ValueError, match="has the name of a reward function"):
        scorer(["p"], ["a"], {}, parts={"test_columns_none_for_z": [1.0]})


def test_an_outcome_none_beside_a_process_reward_is_out_of_the_outcome_baseline():
    """Process rewards score every completion's steps, but an outcome reward's None is still "not applicable": the
    completion's outcome advantage is 0 and out of its group's outcome baseline, its steps keep theirs (before: the
    process reward made every completion scorable, so the None counted as an outcome reward of 0)."""
    tokenizer = build_char_tokenizer()
    texts = itertools.cycle(["ab1c", "z1b", "abc", "a"])
    batch = sample_and_score(
        {"prompt": ["1="]},
        engine=ScriptedEngine(tokenizer, lambda context: next(texts) + EOS),
        encoder=PromptEncoder(tokenizer),
        scorer=Scorer([RewardSpec("test_columns_none_for_z"), RewardSpec("test_columns_steps")]),
        params=SamplingParams(group_size=4, max_new_tokens=8),
    )
    assert batch.unscorable.tolist() == [False, True, False, False]
    settings = RoundSettings(sampling=SamplingConfig(group_size=4), advantage=AdvantageConfig(), optimizer_steps=1)
    advantages = compute_advantages(batch, settings)
    steps = process_advantages(batch.step_rewards, batch.step_ends, batch.completion_mask, 4)
    outcome = ((advantages - steps) * batch.completion_mask).sum(-1) / batch.completion_mask.sum(-1)
    lengths = torch.tensor([4.0, 3.0, 1.0])  # the scored ones: mean 8/3, population std √(14/9)
    expected = (lengths - lengths.mean()) / (lengths.std(unbiased=False) + 1e-4)
    torch.testing.assert_close(outcome, torch.tensor([expected[0], 0.0, expected[1], expected[2]]))
