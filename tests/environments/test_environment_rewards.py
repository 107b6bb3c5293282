"""An environment's reward is a reward column like a reward function's: one rule for None and one weight.

A scripted policy plays G trajectories per prompt against environments written here (and skyrl-gym's, OpenEnv's
reward lines); the rewards of ``data.rewards`` and the environment's parts meet in the scorer: the weighted total
leaves None out, a trajectory is unscorable only when no column gives it a value, and a part's weight is applied
where the scorer applies a reward function's (so GDPO's per-column normalisation keeps it).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_multiturn import EOS, ScriptedEngine

from grpo_lightning.config import AdvantageConfig, SamplingConfig
from grpo_lightning.engines.base import SamplingParams
from grpo_lightning.integrations.environments import Environment, Step
from grpo_lightning.models.tiny import build_char_tokenizer
from grpo_lightning.rewards import RewardSpec, register
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.prompts import PromptEncoder
from grpo_lightning.rollout.round import RoundSettings, SampledRound, agreed_names, compute_advantages, finish_round
from grpo_lightning.rollout.sample_and_score import sample_and_score


@register("test_env_rewards_abstains")
def abstains(prompts, completions, **_):
    """Not applicable to any completion (TRL's None)."""
    return [None] * len(completions)


@register("test_env_rewards_length")
def length(prompts, completions, **_):
    return [float(len(c)) for c in completions]


class Judged(Environment):
    """One turn, then ``final_rewards`` gives the next value of ``VALUES`` (a TRL class's ``get_reward``); a None is
    no part at all, as ``TRLEnvironment`` gives it for a ``get_reward`` that returns None."""

    VALUES: itertools.cycle = itertools.cycle([None])
    WEIGHTS: dict[str, float] = {}  # noqa: RUF012

    def reset(self, row):
        return None

    def step(self, turn):
        return Step(done=True)

    def final_rewards(self):
        value = next(Judged.VALUES)
        return {} if value is None else {"judge": value}

    def reward_weights(self):
        return dict(Judged.WEIGHTS)


def rollout(values, *, rewards, group=4, prompts=1, weights=None, texts=None):
    """A scored multi-turn batch: trajectory i's environment part is ``values[i % len(values)]``."""
    Judged.VALUES, Judged.WEIGHTS = itertools.cycle(values), dict(weights or {})
    tokenizer = build_char_tokenizer()
    answers = itertools.cycle(texts or ["42"])
    engine = ScriptedEngine(tokenizer, lambda context: next(answers) + EOS)
    return sample_and_score(
        {"prompt": [f"{i}=" for i in range(prompts)]},
        engine=engine,
        encoder=PromptEncoder(tokenizer),
        scorer=Scorer([RewardSpec(name, weight=w) for name, w in rewards]),
        params=SamplingParams(group_size=group, max_new_tokens=20),
        environment=Judged(),
    )


def settings(group=4, **advantage):
    return RoundSettings(
        sampling=SamplingConfig(group_size=group), advantage=AdvantageConfig(**advantage), optimizer_steps=1
    )


def test_environment_rewards_teach_when_every_reward_function_abstains():
    """Issue 50 item 1: environment rewards [1, 0, 1, 0], reward functions all None: the environment scored every
    trajectory, so none is unscorable and the advantages are ±1 (before: all unscorable, every advantage 0)."""
    batch = rollout([1.0, 0.0, 1.0, 0.0], rewards=[("test_env_rewards_abstains", 1.0)])
    assert batch.reward_columns["env_judge"] == [1.0, 0.0, 1.0, 0.0]
    assert batch.unscorable.tolist() == [False] * 4
    torch.testing.assert_close(
        compute_advantages(batch, settings()), torch.tensor([1.0, -1.0, 1.0, -1.0]) * 0.5 / 0.5001
    )


def test_a_part_the_environment_did_not_give_is_none_and_only_no_value_at_all_is_unscorable():
    """A trajectory whose environment gave no part (a TRL class's get_reward returning None, a trajectory of another
    class) is None in that column, as TRL's NaN: left out of the total and out of the baseline when no other column
    scores it (before: 0, in the baseline)."""
    batch = rollout([1.0, None, 0.0, None], rewards=[("test_env_rewards_abstains", 1.0)])
    assert batch.reward_columns["env_judge"] == [1.0, None, 0.0, None]
    assert batch.unscorable.tolist() == [False, True, False, True]
    torch.testing.assert_close(
        compute_advantages(batch, settings()), torch.tensor([1.0, 0.0, -1.0, 0.0]) * 0.5 / 0.5001
    )
    scored = rollout([1.0, None, 0.0, None], rewards=[("test_env_rewards_length", 1.0)], texts=["4", "42", "4", "42"])
    assert scored.unscorable.tolist() == [False] * 4 and scored.rewards.tolist() == [2.0, 2.0, 1.0, 2.0]


def test_a_round_no_reward_reaches_trains_on_zero_advantages():
    """No data.rewards and no environment part this round: no column at all. Every trajectory is unscorable and its
    advantage 0 (before: no advantages, and the round failed on them)."""
    batch = rollout([None], rewards=[])
    assert batch.reward_columns == {} and batch.unscorable.all()
    out = finish_round(SampledRound(batch), logprobs=lambda b, old, ref: (None, None), settings=settings())
    assert torch.equal(out.advantages, torch.zeros(4))
    assert out.metrics["rollout/zero_std_group_fraction"] == 1.0


def test_a_column_another_rank_has_is_none_here():
    """Under data parallelism every rank takes every rank's columns (``agreed_names``); a part this rank's
    trajectories never earned is None here, not 0: its rows stay unscorable and out of the baselines."""
    batch = rollout([None], rewards=[])
    other_rank = {"reward_columns": ["env_judge"], "turn_stats": ["turns"], "extra_columns": []}
    batch.align_columns(agreed_names(batch.column_names(), lambda names: [names, other_rank]))
    assert batch.reward_columns == {"env_judge": [None] * 4}
    out = finish_round(SampledRound(batch), logprobs=lambda b, old, ref: (None, None), settings=settings())
    assert torch.equal(out.advantages, torch.zeros(4))


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_an_environments_weight_is_a_column_weight(aggregation):
    """Issue 56 item 7: the environment's part weighs its column where the scorer weighs a reward function's: the
    total is 1 × length + w × judge, and GDPO's per-column normalisation keeps w (before: w was multiplied into the
    column, which GDPO's normalisation cancelled: the same advantages for w = 0.01 and w = 100)."""
    texts, judged = ["4", "42", "42", "4"], [1.0, 0.0, 1.0, 0.0]
    advantages = {}
    for weight in (0.01, 100.0):
        batch = rollout(judged, rewards=[("test_env_rewards_length", 1.0)], weights={"judge": weight}, texts=texts)
        assert batch.reward_columns["env_judge"] == judged  # the environment's own values, unweighted
        assert batch.rewards.tolist() == pytest.approx([1 + weight, 2.0, 2 + weight, 1.0])
        advantages[weight] = compute_advantages(batch, settings(multi_objective_aggregation=aggregation))
    assert advantages[100.0][0] > 0 > advantages[0.01][0]  # the judge dominates at 100, the length at 0.01
    assert not torch.allclose(advantages[0.01], advantages[100.0], atol=0.1)


def test_skyrl_gym_and_openenv_declare_their_weight_instead_of_multiplying():
    """Both return their environment's reward as it is and declare ``reward_weight`` as their column's weight."""
    pytest.importorskip("skyrl_gym")
    from test_skyrl_gym import rollout as skyrl_rollout

    from grpo_lightning.integrations.environments import SkyRLGymEnvironment

    env = SkyRLGymEnvironment(env_id="grpo_test_countdown", reward_weight=100.0, max_turns=3)
    out = skyrl_rollout(env, {"prompt": [[{"role": "user", "content": "go"}]], "count": [2]}, lambda c: "ok<|im_end|>")
    assert out.env_rewards["skyrl_gym"] == [0.5 + 2.0] * 2  # its step rewards, summed; not × 100
    assert env.reward_weights() == {"skyrl_gym": 100.0}

    pytest.importorskip("openenv")
    import openenv_guess
    from test_openenv import ROWS, guessing_policy, make_env, served
    from test_openenv import rollout as openenv_rollout

    with served(openenv_guess.app) as url:
        env = make_env(url, reward_weight=100.0, reward_name="guess")
        rows = {name: values[:1] for name, values in ROWS.items()}
        out = openenv_rollout(env, rows, guessing_policy)
        env.close()
    assert out.env_rewards["guess"] == pytest.approx([0.8, 0.8])  # -0.1, -0.1, 1: not × 100
    assert env.reward_weights() == {"guess": 100.0}
