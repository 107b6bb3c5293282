"""Partial rollouts of a multi-turn environment in whole runs: the calculator demo's ``tiny-calc`` (it calls the
tool in a good share of its samples) against ``ToolEnvironment``, the background process, the checkpoints.

With ``tokens_per_push`` >= ``max_new_tokens`` no trajectory spans a push, and the run trains on the very tensors of
``rollout_lag: 1`` with the same environment. With a small budget trajectories span several pushes, their turns cut
mid-way and tool calls answered in the background, their observations joining a push later; 3 rounds, then 3 more
from the checkpoint (the environments of the trajectories in flight replayed in the new background process, the steps
running at the checkpoint with them) equal 6 rounds, tensor for tensor.
"""

from __future__ import annotations

import pytest
import torch
from test_multiturn_engines import fit

from grpo_lightning.config import ScheduleConfig

pytestmark = pytest.mark.slow  # whole runs with a background process each: the slow tier (`pytest -m slow`)

MAX_NEW = 96  # test_multiturn_engines.fit's


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_budget_that_covers_max_new_tokens_trains_on_exactly_the_tensors_of_lag_1(tmp_path):
    lag_module, lag = fit(tmp_path / "lag", 3, schedule=ScheduleConfig(rollout_lag=1))
    schedule = ScheduleConfig(rollout_lag=1, partial_rollouts=True, tokens_per_push=MAX_NEW, max_staleness=1)
    module, run = fit(tmp_path / "partial", 3, schedule=schedule)
    assert sum(max(r.turn_stats["turns"]) for r in lag.rollouts) > 3  # trajectories of several turns
    assert [r.transcripts for r in run.rollouts] == [r.transcripts for r in lag.rollouts]
    for a, b in zip(run.rollouts, lag.rollouts, strict=True):
        for name in ("completion_ids", "action_mask", "engine_logprobs", "rewards", "advantages"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert a.metrics["rollout/interrupted_sequences"] == 0
    assert same(run.losses, lag.losses)
    for name, value in lag_module.state_dict().items():
        assert torch.equal(module.state_dict()[name], value), name


def test_three_rounds_then_three_more_equal_six_with_trajectories_in_flight_across_the_checkpoint(tmp_path):
    schedule = ScheduleConfig(rollout_lag=1, partial_rollouts=True, tokens_per_push=20, max_staleness=8)
    reference, ref = fit(tmp_path / "reference", 6, schedule=schedule)
    interrupted = [r.metrics["rollout/interrupted_sequences"] for r in ref.rollouts]
    assert sum(n > 0 for n in interrupted) >= 4, interrupted  # trajectories that spanned pushes, in most rounds
    assert sum(max(r.turn_stats["turns"]) for r in ref.rollouts) > 6  # tool calls answered across pushes
    _, first = fit(tmp_path / "run", 3, schedule=schedule)
    saved = torch.load(tmp_path / "run" / "last.ckpt", weights_only=True)
    (state,) = next(v for k, v in saved.items() if "DataModule" in k)["background"]  # one rank's
    in_flight = [s for g in state["pool"]["groups"] for s in g["samples"] if not s["ended"]]
    # In flight past a tool call: its step still running at the checkpoint (the resumed run replays reset and that
    # step; a replay of steps already answered is checked in tests/rollout/test_partial_multiturn.py).
    assert in_flight and any(s["state"]["pending"] for s in in_flight), "no step running across the checkpoint"
    module, second = fit(tmp_path / "run", 6, ckpt_path="last", schedule=schedule)
    rollouts = first.rollouts + second.rollouts
    assert [r.transcripts for r in rollouts] == [r.transcripts for r in ref.rollouts]
    assert all(torch.equal(a.completion_ids, b.completion_ids) for a, b in zip(rollouts, ref.rollouts, strict=True))
    assert same(first.losses + second.losses, ref.losses)
    for name, value in reference.state_dict().items():
        assert torch.equal(module.state_dict()[name], value), name
