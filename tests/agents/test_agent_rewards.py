"""An agent's return value is a reward column like a reward function's (``integrations/agents/rollout.py``): None is
"not
applicable", a session no column scores is left out of its group's baseline, and a failed session (``on_error:
skip``) is out of every column, so that the sum's advantages and GDPO's agree on who is scored.

The agents run against the round's gateway on ``tiny-calc`` (``test_agent_gateway.py``'s fixture), one at a time so
that the i-th session returns the i-th value.
"""

from __future__ import annotations

import itertools

import torch
from test_agent_gateway import calc, client, run  # noqa: F401 - calc is the fixture

from grpo_lightning.config import AdvantageConfig, SamplingConfig
from grpo_lightning.rewards import RewardSpec, register
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.round import RoundSettings, SampledRound, finish_round

ROWS = {"prompt": ["12*34="], "answer": ["408"]}


@register("test_agent_rewards_length")
def call_length(prompts, completions, **_):
    return [float(len(c)) for c in completions]


def returning(values):
    """An agent that makes one call, then returns the next of ``values`` (raising for ``"raise"``)."""
    values = iter(values)

    def agent(base_url, api_key, row):
        client(base_url, api_key).completions.create(model="p", prompt=row["prompt"], max_tokens=4)
        value = next(values)
        if value == "raise":
            raise ValueError("the tool broke")
        return value

    return agent


def advantages(batch, group=4, **advantage):
    settings = RoundSettings(
        sampling=SamplingConfig(group_size=group),
        advantage=AdvantageConfig(**advantage),
        optimizer_steps=1,
        reference=False,
    )
    return finish_round(SampledRound(batch), logprobs=lambda b, old, ref: (None, None), settings=settings).advantages


def test_an_agent_that_returns_none_is_left_out_of_its_groups_baseline(calc):  # noqa: F811
    """Issue 50 item 2: agent rewards [None, 0, None, 1] with ``data.rewards: []``: the None sessions are
    unscorable, advantage 0, and the others are ±1 over {0, 1} (before: None scored 0, [-0.58, -0.58, -0.58, 1.73])."""
    _, tokenizer, engine = calc
    agent = returning([None, 0.0, None, 1.0])
    batch = run(engine, tokenizer, agent, rows=ROWS, group=4, scorer=Scorer([]), max_concurrency=1)
    assert batch.reward_columns == {"agent": [None, 0.0, None, 1.0]}
    assert batch.unscorable.tolist() == [True, False, True, False]
    torch.testing.assert_close(advantages(batch), torch.tensor([0.0, -1.0, 0.0, 1.0]) * 0.5 / 0.5001)
    gdpo = advantages(batch, multi_objective_aggregation="normalize_then_sum")
    assert gdpo[0] == gdpo[2] == 0 and gdpo[1] < 0 < gdpo[3]  # the two paths agree on who is scored


def test_a_failed_session_is_out_of_every_column_and_both_aggregations(calc):  # noqa: F811
    """``on_error: skip``: the failed session's own columns are None, so neither the sum nor GDPO counts it in its
    group (before: data.rewards still scored its text, and GDPO put it in the group's statistics)."""
    _, tokenizer, engine = calc
    scorer = Scorer([RewardSpec("test_agent_rewards_length")])
    agent = returning(["raise", 1.0, 0.0, 1.0])
    batch = run(engine, tokenizer, agent, rows=ROWS, group=4, scorer=scorer, max_concurrency=1, on_error="skip")
    assert batch.agent_log["failed_sessions"] == 1 and batch.unscorable.tolist() == [True, False, False, False]
    assert batch.reward_columns["agent"][0] is None and batch.reward_columns["test_agent_rewards_length"][0] is None
    for aggregation in ("sum_then_normalize", "normalize_then_sum"):
        assert advantages(batch, multi_objective_aggregation=aggregation)[0] == 0


def test_the_session_order_is_the_agents(calc):  # noqa: F811
    """One at a time (``max_concurrency: 1``), the i-th session is the i-th agent run: what the tests above rely on."""
    _, tokenizer, engine = calc
    counter = itertools.count()
    batch = run(engine, tokenizer, returning([float(next(counter)) for _ in range(4)]), rows=ROWS, group=4,
                scorer=Scorer([]), max_concurrency=1)  # fmt: skip
    assert batch.reward_columns == {"agent": [0.0, 1.0, 2.0, 3.0]}


@register("test_agent_rewards_transcripts")
def transcript_seen(prompts, completions, transcripts, **_):
    """Records the ``transcripts`` column the rewards are given, and scores nothing."""
    transcript_seen.seen.extend(transcripts)
    return [None] * len(completions)


transcript_seen.seen = []


def test_the_transcript_column_is_the_row_of_the_scored_call(calc):  # noqa: F811
    """An agent whose last call continues its first conversation (token ids) after a second, fresh one: its
    session has two rows and the call the rewards score sits in the first; the ``transcripts`` column is that row's
    (before: the last row's, a conversation the reward never scored)."""
    _, tokenizer, engine = calc
    texts = []

    def interleaving(base_url, api_key, row):
        model, ids = client(base_url, api_key), {"return_token_ids": True}
        first = model.completions.create(model="p", prompt=row["prompt"], max_tokens=2, extra_body=ids)
        model.completions.create(model="p", prompt="9*9=", max_tokens=3, extra_body=ids)  # a second conversation
        first_ids = first.choices[0].model_extra["token_ids"]
        prompt = first.model_extra["prompt_token_ids"] + first_ids
        last = model.completions.create(model="p", prompt=prompt, max_tokens=5, extra_body=ids)
        texts.append(tokenizer.decode(first_ids + last.choices[0].model_extra["token_ids"]))  # the first row's
        return 1.0

    transcript_seen.seen.clear()
    scorer = Scorer([RewardSpec("test_agent_rewards_transcripts")])
    batch = run(engine, tokenizer, interleaving, rows=ROWS, group=2, scorer=scorer, max_concurrency=1)
    assert batch.agent_log["split_sessions"] == 2  # two rows a session: the mechanism under test
    assert transcript_seen.seen == texts
