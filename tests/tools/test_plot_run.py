"""``tools/plot_run.py --learning-curve``: held-out accuracy and training reward per round, drawn from a small
synthetic ``metrics.csv`` (no training run). The four-panel plot of a real run is tested in
tests/callbacks/test_observability.py."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from helpers import load_tool

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ROUNDS, STEPS_PER_ROUND, EVAL_EVERY = 12, 3, 4
# Held-out accuracy (a fraction, as logged) after rounds 4, 8, 12; the decoys differ from it, so reading the wrong
# column (val/reward_mean, val/pass@1, test/accuracy) or the wrong row fails the test.
ACCURACY = {4: 0.668, 8: 0.974, 12: 0.982}


def reward(round_: int) -> float:
    return round(0.4 + 0.04 * round_, 4)


def write_metrics(folder: Path) -> Path:
    """A ``CSVLogger``-shaped ``metrics.csv``: epoch 0-based (round = epoch + 1), several optimizer steps a round,
    each metric in its own row with the others' cells empty, as Lightning writes it."""
    columns = ["epoch", "step", "train/loss", "rollout/reward_mean", "val/accuracy", "val/reward_mean", "val/pass@1"]
    rows: list[dict[str, object]] = []
    for epoch in range(ROUNDS):
        round_ = epoch + 1
        for k in range(STEPS_PER_ROUND):
            step = epoch * STEPS_PER_ROUND + k
            rows.append({"epoch": epoch, "step": step, "train/loss": 0.1 * k})
        last = epoch * STEPS_PER_ROUND + STEPS_PER_ROUND - 1
        if round_ in ACCURACY:
            rows.append(
                {
                    "epoch": epoch,
                    "step": last,
                    "val/accuracy": ACCURACY[round_],
                    "val/reward_mean": 0.5,
                    "val/pass@1": 0.1,
                }
            )
        rows.append({"epoch": epoch, "step": last, "rollout/reward_mean": reward(round_)})
    folder.mkdir(parents=True)
    path = folder / "metrics.csv"
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_learning_curve_plots_the_held_out_accuracy_and_reward_per_round(tmp_path):
    pytest.importorskip("matplotlib")  # the "plot" extra (also in "dev")
    plot_run = load_tool("plot_run")
    write_metrics(tmp_path / "run" / "version_0")
    out, drawn = plot_run.plot_learning_curve(tmp_path / "run", tmp_path / "curve.png", title="configs/demo.yaml")
    assert out == tmp_path / "curve.png" and out.read_bytes()[:8] == PNG_MAGIC
    assert out.stat().st_size < 100_000
    rounds, percent = drawn["accuracy"]
    assert rounds == [4.0, 8.0, 12.0]  # rounds (epoch + 1), not optimizer steps (11, 23, 35)
    assert percent == pytest.approx([100 * ACCURACY[r] for r in (4, 8, 12)])
    rounds, rewards = drawn["reward"]
    assert rounds == [float(r) for r in range(1, ROUNDS + 1)]
    assert rewards == pytest.approx([reward(r) for r in range(1, ROUNDS + 1)])
    assert drawn["title"] == "configs/demo.yaml"
    assert drawn["annotations"][-1] == "98.2%"  # the final figure is written on the plot


def test_learning_curve_command_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot_run = load_tool("plot_run")
    metrics = write_metrics(tmp_path / "run")
    plot_run.main([str(metrics), "--learning-curve"])
    out = tmp_path / "run" / "learning_curve.png"
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert "98.2%" in capsys.readouterr().out


def test_learning_curve_refuses_a_run_without_held_out_accuracy(tmp_path):
    pytest.importorskip("matplotlib")
    plot_run = load_tool("plot_run")
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.csv").write_text("epoch,step,rollout/reward_mean\n0,0,0.5\n")
    with pytest.raises(ValueError, match="val/accuracy"):
        plot_run.plot_learning_curve(folder, tmp_path / "curve.png")
