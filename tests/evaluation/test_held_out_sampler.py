"""Held-out evaluation's data side (``rollout/held_out.py``) at its seams, in one process.

- Ranks' shares: every rank gets the same number of batches (each batch gathers a sharded policy's weights, a
  collective every rank must join), the short ranks a padding batch whose scores are dropped: the metrics are those
  of the real rows only.
- Agent sessions split into several rows: maj@k votes on, and the lengths are those of, the text the rewards
  scored (the session's last call), not the session's first row.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import openai
import pytest
import torch
from datasets import Dataset
from test_agent_gateway import calc  # noqa: F401 - the fixture, used by name

from grpo_lightning.config import EvalConfig, SamplingConfig
from grpo_lightning.integrations.agents import AgentEnvironment
from grpo_lightning.integrations.agents.calls import AgentRow, Call, merge_calls, scored_row
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout.held_out import HeldOutSampler, held_out_loader
from grpo_lightning.rollout.prompts import PromptEncoder

ROWS = [{"prompt": p, "answer": a} for p, a in (("12*34=", "408"), ("56*78=", "4368"), ("9*9=", "81"))]


def sampler_for(engine, tokenizer, k=0, environment=None, max_new_tokens=6):
    policy = SimpleNamespace(device=torch.device("cpu"), rollout_context=contextlib.nullcontext)
    return HeldOutSampler(
        module=lambda: policy,
        engine=lambda: engine,
        encoder=lambda: PromptEncoder(tokenizer, False),
        scorer=Scorer(),
        sampling=SamplingConfig(group_size=2, max_new_tokens=max_new_tokens),
        config=EvalConfig(num_samples=k),
        seed=0,
        environment=environment,
    )


# ------------------------------------------------------------------------------------------ ranks' shares
@pytest.mark.parametrize("rows,batch_size,world", [(5, 2, 2), (3, 1, 4), (7, 3, 3), (4, 2, 2)])
def test_every_rank_gets_as_many_batches_and_the_real_rows_once(rows, batch_size, world):
    data = Dataset.from_list([{"prompt": str(i)} for i in range(rows)])
    shares = [list(held_out_loader(data, batch_size, list, rank=r, world_size=world)) for r in range(world)]
    assert len({len(batches) for batches in shares}) == 1, [len(b) for b in shares]
    real = [i for batches in shares for batch in batches for i, _ in batch if i >= 0]
    assert sorted(real) == list(range(rows))  # each row once, on one rank
    for batches in shares:
        assert all(len(batch) <= batch_size for batch in batches)
        assert all(all(i < 0 for i, _ in b) or all(i >= 0 for i, _ in b) for b in batches)  # padding: alone


def test_a_padding_batch_is_generated_and_counts_nothing(calc):  # noqa: F811 - the fixture
    _, tokenizer, engine = calc
    data = Dataset.from_list(ROWS)
    sampler = sampler_for(engine, tokenizer, k=2)
    entered = []
    policy = SimpleNamespace(
        device=torch.device("cpu"), rollout_context=lambda: entered.append(1) or contextlib.nullcontext()
    )
    sampler.module = lambda: policy
    # 3 rows on 2 ranks, batches of 1: rank 0 has 2, rank 1 has 1 and a padding batch.
    real, padding = list(held_out_loader(data, 1, sampler, rank=1, world_size=2))
    assert len(entered) == 2  # the padding batch entered the rollout context too: the same collectives
    assert set(padding) == set(real)  # the same metrics are logged
    for key, value in padding.items():
        if key != "pass_k":
            assert len(value) == 0, key
    assert padding["pass_k"] == real["pass_k"] == [1, 2] and padding["sample_correct"].shape == (0, 2)
    alone = list(held_out_loader(data, 1, sampler, rank=0, world_size=1))  # one process: the same batches
    torch.testing.assert_close(alone[2]["reward"], real["reward"])


# ---------------------------------------------------------------------------- agent sessions × maj@k
def test_the_scored_row_holds_the_sessions_last_call():
    def call(prompt, completion):
        return Call(prompt, completion, [0.0] * len(completion), None, "t", "stop")

    assert scored_row(merge_calls([call([1], [2]), call([5], [6])])) == 1  # a fresh conversation last
    assert scored_row(merge_calls([call([1], [2]), call([5], [6]), call([1, 2, 3], [4])])) == 0  # continued the first
    assert scored_row([AgentRow([1], [0], [0], [0.0], [0.0])]) == 0  # a session without calls: its placeholder


def test_maj_at_k_and_lengths_read_the_text_the_reward_scored(calc):  # noqa: F811 - the fixture
    _, tokenizer, engine = calc
    seen: dict[str, list[tuple[str, int]]] = {}  # prompt → (the session's last text, its row's length), in order

    def two_conversations(base_url, api_key, row):
        """A first call, a second conversation from a fresh prompt; on the second row's prompt a third call that
        continues the first conversation (token ids): the last call is in the last row, or in the first."""
        model = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30)
        ids = {"return_token_ids": True}
        first = model.completions.create(model="p", prompt=row["prompt"], max_tokens=2, extra_body=ids)
        first_ids = first.choices[0].model_extra["token_ids"]
        last = model.completions.create(model="p", prompt=f"{row['answer']}=", max_tokens=7, extra_body=ids)
        length = len(last.choices[0].model_extra["token_ids"])
        if row["prompt"].startswith("56"):
            prompt = first.model_extra["prompt_token_ids"] + first_ids
            last = model.completions.create(model="p", prompt=prompt, max_tokens=7, extra_body=ids)
            length = len(first_ids) + len(last.choices[0].model_extra["token_ids"])
        seen.setdefault(row["prompt"], []).append((last.choices[0].text, length))
        return None

    k = 3
    environment = AgentEnvironment(agent=two_conversations)
    sampler = sampler_for(engine, tokenizer, k=k, environment=environment, max_new_tokens=7)
    out = sampler([(i, row) for i, row in enumerate(ROWS[:2])])
    for b, row in enumerate(ROWS[:2]):
        (greedy_text, greedy_length), *samples = seen[row["prompt"]]  # greedy sessions run before the samples
        assert out["length"][b].item() == greedy_length, row["prompt"]
        assert sorted(out["sample_answers"][b]) == sorted(text.strip() for text, _ in samples), row["prompt"]
        lengths = out["sample_length"][b * k : (b + 1) * k].tolist()
        assert sorted(lengths) == sorted(float(n) for _, n in samples), row["prompt"]
