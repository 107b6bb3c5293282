"""Per-row columns and round metrics when draws of a round, or ranks, saw different environment names.

An environment names its metrics and reward parts by what a trajectory did (``tool_calls`` only where a tool was
called), so two draws of a DAPO round, or two ranks' rounds, can hold different names. ``RolloutBatch.concat``
joins all of them (a count 0 where a draw had none, a reward part None: not applicable, as a trajectory that did
not earn it), ``run_round`` makes every rank take the names of all ranks, and
``merge_rank_metrics`` reduces every rank's metrics alike (the 2-process run: ``test_rollout_metrics_ddp.py``).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from grpo_lightning.config import AdvantageConfig, SamplingConfig
from grpo_lightning.engines.base import Completions, RolloutEngine, SamplingParams
from grpo_lightning.integrations.environments import Environment, Step
from grpo_lightning.metrics import merge_rank_metrics
from grpo_lightning.models.tiny import build_char_tokenizer
from grpo_lightning.rewards import RewardSpec, register
from grpo_lightning.rewards.scorer import Scorer
from grpo_lightning.rollout import round as round_module
from grpo_lightning.rollout.batch import RolloutBatch
from grpo_lightning.rollout.prompts import PromptEncoder
from grpo_lightning.rollout.round import RoundSettings, run_round

BASE_STATS = ["turns", "policy_tokens", "env_tokens"]  # what every multi-turn rollout counts


def rows_batch(n: int, turn_stats: dict[str, list[float]], reward_columns: dict[str, list[Any]]) -> RolloutBatch:
    ids = torch.arange(n * 2).view(n, 2)
    return RolloutBatch(
        prompt_ids=ids,
        prompt_mask=torch.ones_like(ids),
        completion_ids=ids,
        completion_mask=torch.ones_like(ids),
        truncated=torch.zeros(n, dtype=torch.bool),
        rewards=torch.zeros(n),
        turn_stats=turn_stats,
        reward_columns=reward_columns,
    )


@pytest.mark.parametrize("tool_draw", ["first", "second"])
def test_concat_joins_the_names_of_all_draws(tool_draw: str) -> None:
    """The draw that called a tool (and earned ``env_bonus``) first or second: either way every name is kept, and
    the other draw's rows count 0 calls and have no bonus, None (HEAD: KeyError, or the names dropped)."""
    called = rows_batch(2, {"turns": [2.0, 1.0], "tool_calls": [1.0, 0.0]}, {"r": [1.0, None], "env_bonus": [0.5, 0]})
    plain = rows_batch(1, {"turns": [1.0]}, {"r": [0.0]})
    draws = [called, plain] if tool_draw == "first" else [plain, called]
    joined = RolloutBatch.concat(draws, pad_token_id=0)
    if tool_draw == "first":
        assert joined.turn_stats == {"turns": [2.0, 1.0, 1.0], "tool_calls": [1.0, 0.0, 0.0]}
        assert joined.reward_columns == {"r": [1.0, None, 0.0], "env_bonus": [0.5, 0, None]}
    else:
        assert joined.turn_stats == {"turns": [1.0, 2.0, 1.0], "tool_calls": [0.0, 1.0, 0.0]}
        assert joined.reward_columns == {"r": [0.0, 1.0, None], "env_bonus": [None, 0.5, 0]}
    # select keeps every name, its rows in step with the tensors
    picked = joined.select(torch.tensor([2, 0]))
    assert list(picked.turn_stats) == list(joined.turn_stats)
    assert picked.turn_stats["tool_calls"] == [joined.turn_stats["tool_calls"][i] for i in (2, 0)]
    assert picked.completion_ids.tolist() == joined.completion_ids[[2, 0]].tolist()


# ----------------------------------------------------------------------------- through run_round
@register("metrics_spread_on_odd")
def spread_on_odd(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """Spread within the groups of prompts starting with 1 or 3 (informative); 0 elsewhere (filtered out)."""
    return [float(len(c)) if p[0] in "13" else 0.0 for p, c in zip(prompts, completions)]


class CountingEngine(RolloutEngine):
    """The g-th sample of each group is ``g + 1`` letters, then EOS: every group's completions differ."""

    name = "counting"

    def __init__(self, tokenizer: Any) -> None:
        super().__init__()
        self.tokenizer = tokenizer

    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
        return_logprobs: bool = False,
    ) -> Completions:
        group = params.group_size
        eos = self.tokenizer.eos_token_id
        rows = [
            self.tokenizer("a" * (i % group + 1), add_special_tokens=False)["input_ids"] + [eos]
            for i in range(prompt_ids.size(0) * group)
        ]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [self.tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        return Completions(
            prompt_ids.repeat_interleave(group, 0),
            prompt_mask.repeat_interleave(group, 0),
            ids,
            mask,
            torch.zeros(len(rows), dtype=torch.bool),
        )


class ToolOnSome(Environment):
    """One turn; a trajectory of a prompt in ``tool_prompts`` made a tool call and earned ``bonus``."""

    def __init__(self, tool_prompts: tuple[str, ...] = ()) -> None:
        super().__init__(max_turns=1)
        self.tool_prompts = tool_prompts

    def reset(self, row: dict[str, Any]) -> None:
        self.calls = row["prompt"] in self.tool_prompts
        return None

    def step(self, turn: str) -> Step:
        return Step(done=True, rewards={"bonus": 1.0}, metrics={"tool_calls": 1.0}) if self.calls else Step(done=True)


def round_of(draws: list[list[str]], environment: Environment | None, *, dynamic: bool, **kwargs: Any) -> RolloutBatch:
    tokenizer = build_char_tokenizer()
    prompts = iter(draws)
    settings = RoundSettings(
        sampling=SamplingConfig(group_size=2, max_new_tokens=8),
        advantage=AdvantageConfig(),
        optimizer_steps=1,
        dynamic_sampling=dynamic,
        environment=environment,
        reference=False,
    )
    return run_round(
        lambda: {"prompt": next(prompts)},
        engine=CountingEngine(tokenizer),
        encoder=PromptEncoder(tokenizer),
        scorer=Scorer([RewardSpec("metrics_spread_on_odd")]),
        logprobs=lambda batch, *, old, ref: (None, None),
        settings=settings,
        generator=torch.Generator().manual_seed(0),
        **kwargs,
    )


@pytest.mark.parametrize("tool_draw", ["first", "second"])
def test_dynamic_sampling_keeps_an_environment_metric_of_one_draw(tool_draw: str) -> None:
    """Draw 1 keeps the group of 1+1= (2+2= has no spread), draw 2 adds 3+3=; only one draw's prompts call a tool
    (HEAD: KeyError 'tool_calls' when it is the first draw, the metric silently gone when it is the second)."""
    draws = [["1+1=", "2+2="], ["3+3=", "4+4="]]
    batch = round_of(draws, ToolOnSome(tuple(draws[0 if tool_draw == "first" else 1])), dynamic=True)
    assert batch.prompts == ["1+1=", "1+1=", "3+3=", "3+3="]
    expected = [1.0, 1.0, 0.0, 0.0] if tool_draw == "first" else [0.0, 0.0, 1.0, 1.0]
    assert list(batch.turn_stats) == [*BASE_STATS, "tool_calls"] and batch.turn_stats["tool_calls"] == expected
    assert list(batch.reward_columns) == ["metrics_spread_on_odd", "env_bonus"]
    assert batch.reward_columns["env_bonus"] == [v or None for v in expected]  # not earned: None, not applicable
    assert batch.metrics["rollout/tool_calls_mean"] == 0.5 and batch.metrics["reward/env_bonus"] == 1.0
    assert batch.metrics["rollout/sampling_rounds"] == 2.0


def test_every_rank_takes_the_names_of_all_ranks() -> None:
    """This rank called no tool; another one did: this rank's rows count 0 calls and have no bonus (None, as a
    trajectory of the other rank that earned none: one rule on every rank), and it summarises (and so logs) the
    same metrics, in the same order (HEAD: no ``per_rank``, the names stayed this rank's)."""
    asked: list[dict[str, list[str]]] = []
    other = {
        "reward_columns": ["metrics_spread_on_odd", "env_bonus"],
        "turn_stats": [*BASE_STATS, "tool_calls"],
        "extra_columns": [],
    }

    def per_rank(names: dict[str, list[str]]) -> list[dict[str, list[str]]]:
        asked.append(names)
        return [other, names]  # rank 0 called a tool; this is rank 1

    batch = round_of([["1+1=", "2+2="]], ToolOnSome(), dynamic=False, per_rank=per_rank)
    assert asked == [{"reward_columns": ["metrics_spread_on_odd"], "turn_stats": BASE_STATS, "extra_columns": []}]
    assert {column: list(getattr(batch, column)) for column in other} == other
    assert batch.turn_stats["tool_calls"] == [0.0] * 4 and batch.reward_columns["env_bonus"] == [None] * 4
    assert batch.metrics["rollout/tool_calls_mean"] == 0.0 and math.isnan(batch.metrics["reward/env_bonus"])
    metric_names = [k for k in batch.metrics if k.startswith(("reward/", "rollout/tool"))]
    assert metric_names == ["reward/metrics_spread_on_odd", "reward/env_bonus", "rollout/tool_calls_mean"]


def test_no_collective_for_names_without_an_environment() -> None:
    """Only an environment's names can differ between ranks: a single-turn round asks nothing of the others."""

    def per_rank(value: Any) -> list[Any]:
        raise AssertionError("a collective a single-turn round does not need")

    batch = round_of([["1+1=", "2+2="]], None, dynamic=False, per_rank=per_rank)
    assert list(batch.reward_columns) == ["metrics_spread_on_odd"] and batch.turn_stats == {}


def test_merge_rank_metrics_is_nan_aware_and_keeps_every_key() -> None:
    nan = float("nan")
    ranks = [
        {"rollout/reward_mean": 1.0, "reward/x": nan, "rollout/completion_length_max": 3.0, "reward/y": nan},
        {
            "rollout/reward_mean": 2.0,
            "reward/x": 4.0,
            "rollout/completion_length_max": 5.0,
            "reward/y": nan,
            "rollout/only_here": 1.0,
        },
    ]
    merged = merge_rank_metrics(ranks)
    # x: NaN on rank 0 (no applicable value), so rank 1's; y: no rank has a value, left out; maxima maximised
    assert merged == {
        "rollout/reward_mean": 1.5,
        "reward/x": 4.0,
        "rollout/completion_length_max": 5.0,
        "rollout/only_here": 1.0,
    }
    assert list(merged) == ["rollout/reward_mean", "reward/x", "rollout/completion_length_max", "rollout/only_here"]
    assert merge_rank_metrics([ranks[0]]) == {
        "rollout/reward_mean": 1.0,
        "rollout/completion_length_max": 3.0,
    }


def test_the_names_of_several_ranks_in_one_order_on_every_rank() -> None:
    names = {"turn_stats": [*BASE_STATS, "b"], "reward_columns": ["r"]}
    others = {"turn_stats": [*BASE_STATS, "a", "b"], "reward_columns": ["r", "env_c"]}
    for mine in (names, others):  # whichever rank asks, the answer is the same
        agreed = round_module.agreed_names(mine, lambda value: [names, others])
        assert agreed == {"turn_stats": [*BASE_STATS, "b", "a"], "reward_columns": ["r", "env_c"]}


def test_align_columns_never_drops_a_name() -> None:
    batch = rows_batch(1, {"turns": [1.0], "tool_calls": [1.0]}, {"r": [1.0]})
    with pytest.raises(ValueError, match="tool_calls"):
        batch.align_columns({"turn_stats": ["turns"], "reward_columns": ["r"]})
    batch.align_columns({"turn_stats": ["tool_calls", "turns", "z"], "reward_columns": ["r", "env_q"]})
    assert batch.turn_stats == {"tool_calls": [1.0], "turns": [1.0], "z": [0.0]}
    assert batch.reward_columns == {"r": [1.0], "env_q": [None]}
