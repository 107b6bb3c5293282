"""Rejection sampling keeps exactly the completions its rule selects, and writes data the SFT module reads."""

from __future__ import annotations

import json

import pytest
import yaml
from helpers import load_tool

tool = load_tool("rejection_sample")


def test_best_keeps_the_first_highest_reward_that_reaches_the_threshold():
    completions = ["a", "b", "c", "d", "e", "f", "g", "h"]
    rewards = [0.2, 1.0, 1.0, 0.5, 0.1, 0.3, 0.0, 0.2]
    # positions within each group of 4; a tie goes to the earlier sample
    assert tool.select_completions(completions, rewards, 4) == [[1], [1]]
    assert tool.select_completions(completions, rewards, 4, threshold=0.5) == [[1], []]
    # a rejected (e.g. truncated) sample is never kept, even when it is the best
    rejected = [False, True, False, False, False, False, False, False]
    assert tool.select_completions(completions, rewards, 4, rejected=rejected) == [[2], [1]]


def test_threshold_keeps_every_passing_sample_once():
    completions = ["12", " 12", "13", "12", "7", "8", "9", "7 "]
    rewards = [1.0, 1.0, 1.5, 0.0, 0.0, 0.0, 0.0, 0.0]
    # " 12" repeats "12" (whitespace aside); "12" at position 3 fails the threshold anyway.
    assert tool.select_completions(completions, rewards, 4, mode="threshold", threshold=1.0) == [[0, 2], []]
    assert tool.select_completions(completions, rewards, 4, mode="threshold", threshold=0.0) == [[0, 2], [0, 1, 2]]
    with pytest.raises(ValueError, match="threshold"):
        tool.select_completions(completions, rewards, 4, mode="threshold")


def test_acceptance_rate_is_the_passing_share_per_prompt():
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert tool.acceptance_rates(rewards, 4, 1.0) == [0.75, 0.0]
    assert tool.acceptance_rates(rewards, 4, 1.0, rejected=[True] + [False] * 7) == [0.5, 0.0]


SCORED: list[tuple[str, str, float]] = []


def recorded_length_reward(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    """Longer completions score higher; every call is recorded for the test to replay the rule."""
    values = [float(len(c.strip())) for c in completions]
    SCORED.extend(zip(prompts, completions, values))
    return values


@pytest.mark.parametrize("mode", ["best", "threshold"])
def test_the_tool_writes_the_selected_completions_as_sft_data(tmp_path, mode, tiny_model_dir):
    config = {
        "model": {"model_name_or_path": tiny_model_dir},
        "data": {
            "rewards": [{"name": f"{__name__}.recorded_length_reward"}],
            "sampling": {"max_new_tokens": 4},
            "task_kwargs": {"max_operand": 9, "test_size": 20},
        },
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "data.jsonl"
    SCORED.clear()
    argv = ["--config", str(path), "--out", str(out), "--k", "4", "--num_prompts", "6", "--mode", mode]
    argv += ["--threshold", "2", "--keep_truncated", "--device", "cpu"]
    summary = tool.main(argv)

    # Replay the rule on every scored sample: the file holds exactly the completions it selects, in order.
    completions, rewards = [c for _, c, _ in SCORED], [r for _, _, r in SCORED]
    kept = tool.select_completions(completions, rewards, 4, mode=mode, threshold=2.0)
    expected = [(SCORED[g * 4 + i][0], SCORED[g * 4 + i][1]) for g, positions in enumerate(kept) for i in positions]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["prompt"], r["response"]) for r in rows] == expected
    assert all("answer" in r and "reward" in r for r in rows)  # the prompt's columns travel with it
    report = [json.loads(line) for line in (tmp_path / "data.acceptance.jsonl").read_text().splitlines()]
    assert [r["acceptance_rate"] for r in report] == tool.acceptance_rates(rewards, 4, 2.0)
    assert summary["prompts"] == 6 and summary["rows_written"] == len(rows)

    if rows:  # the SFT data module reads the file as it is
        from grpo_lightning.rollout.datamodule import load_prompts

        data = load_prompts(str(out), "train")
        assert {"prompt", "response"} <= set(data.column_names)
