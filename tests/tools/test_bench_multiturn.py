"""``tools/bench_multiturn.py`` (its figures are measured by hand): what it compares, and a baseline it refuses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_multiturn  # noqa: E402


def result(rewards, before, after, seconds=1.0):
    rounds = [{"generate_s": seconds, "rollout_s": 2 * seconds, "reward": r} for r in rewards]
    return {"before": before, "after": after, "rounds": rounds}


def test_figures_are_compared_as_the_demo_prints_them_and_bit_for_bit():
    ours, base = result([0.2151, 0.31], 0.3125, 0.5), result([0.2149, 0.31], 0.3125, 0.5)
    assert bench_multiturn.figures(ours) == bench_multiturn.figures(base) == ["0.215", "0.310", "31.2%", "50.0%"]
    assert bench_multiturn.exact(ours) != bench_multiturn.exact(base)
    assert bench_multiturn.per_round(result([0.1, 0.2, 0.3], 0, 0, seconds=1.5), "rollout_s") == 3.0


def test_a_baseline_that_is_not_a_checkout_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_multiturn.py", "--baseline", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_info:
        bench_multiturn.main()
    assert exit_info.value.code == 2 and "git worktree add" in capsys.readouterr().err


def test_a_rounds_rollout_counts_the_environments_seconds_once(monkeypatch):
    # ``time/environment`` is spent inside ``time/generate``: the whole rollout adds it once, in generate.
    from types import SimpleNamespace

    from grpo_lightning.rollout import datamodule

    metrics = {
        "time/generate": 0.5,
        "time/environment": 0.1,
        "time/score": 0.02,
        "time/logprobs": 0.2,
        "time/generated_tokens_per_s": 9000.0,
        "rollout/reward_mean": 0.25,
    }
    monkeypatch.setattr(datamodule, "latest_rollout", lambda trainer: SimpleNamespace(metrics=metrics))
    figures = bench_multiturn.RoundFigures()
    figures.on_train_epoch_start(None, None)
    figures.on_train_batch_start(None, None, None, 0)
    figures.on_train_epoch_end(None, None)
    (round_,) = figures.rounds
    assert round_["generate_s"] == 0.5 and round_["environment_s"] == 0.1 and round_["reward"] == 0.25
    assert round_["rollout_s"] == pytest.approx(0.72) and round_["rollout_cpu_s"] >= 0.0


def test_runs_are_paired_with_the_baseline_run_beside_them(tmp_path, monkeypatch, capsys):
    (tmp_path / "grpo_lightning" / "assets" / "tiny-calc").mkdir(parents=True)
    (tmp_path / "grpo_lightning" / "assets" / "tiny-calc" / "config.json").write_text("{}")
    seconds = {"ours": iter([1.0, 2.0]), "baseline": iter([1.5, 5.0])}  # the second pair ran under more load

    def run_child(side, args, baseline):
        made = result([0.5], 0.25, 0.75, seconds=next(seconds[side]))
        for r in made["rounds"]:
            r["rollout_cpu_s"] = r["generate_s"]
        return made

    monkeypatch.setattr(bench_multiturn, "run_child", run_child)
    monkeypatch.setattr(sys, "argv", ["bench_multiturn.py", "--baseline", str(tmp_path), "--runs", "2"])
    bench_multiturn.main()
    lines = capsys.readouterr().out.splitlines()
    paired = next(line for line in lines if line.startswith("paired runs"))
    assert "generate_s 1.50 2.50" in paired and "(medians 2.00x, 2.00x, 2.00x)" in paired
    assert lines[-2].startswith("rollout ours/baseline: generate 0.46 (2.17x faster)")  # medians of runs: 1.5/3.25
    assert lines[-1].endswith("(rewards of 30 rounds .3f, accuracies .1%): yes; bit for bit: yes")
