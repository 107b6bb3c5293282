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
