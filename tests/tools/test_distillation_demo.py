"""``tools/distillation_demo.py`` (its curves are measured by hand, docs/distillation.md): how it reads a run's
held-out accuracy, finds the first round at the target, and takes its variants."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import distillation_demo  # noqa: E402


def test_held_out_accuracy_is_read_per_round_and_95_percent_in_float32_counts(tmp_path):
    """A validation after round r is logged at epoch r − 1; 475/500 logged in float32 reads 0.9499999881, and must
    still reach a 95% target."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "metrics.csv").write_text(
        "epoch,step,train/loss,val/accuracy\n0,1,0.5,\n1,3,,0.3059999942779541\n3,7,,0.9499999880790710\n"
    )
    accuracy = distillation_demo.held_out_accuracy(tmp_path)
    assert accuracy == {2: 30.6, 4: 95.0}
    assert distillation_demo.first_round(accuracy, 95.0) == 4
    assert distillation_demo.first_round(accuracy, 96.0) is None


def test_a_variant_is_a_name_and_its_overrides_split_as_a_shell_splits_them():
    name, overrides = distillation_demo.parse_variant(
        "reward + teacher, λ 0.3=--data.rewards '[{name: exact_answer, weight: 1.0}]' --model.teacher.weight 0.3"
    )
    assert name == "reward + teacher, λ 0.3"
    assert overrides == ["--data.rewards", "[{name: exact_answer, weight: 1.0}]", "--model.teacher.weight", "0.3"]
    for bad in ("no separator", "=--model.lr 1e-3", "name only="):
        with pytest.raises(SystemExit, match="--variant takes NAME=OVERRIDES"):
            distillation_demo.parse_variant(bad)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--variant", "broken"], "--variant takes NAME=OVERRIDES"),
        (["--no-grpo", "--no-distillation"], "nothing to run: --no-grpo and --no-distillation leave no run"),
        (["--teacher-overrides", "--model.lr '1e-3"], "--teacher-overrides: No closing quotation"),
    ],
    ids=["bad-variant", "nothing-to-run", "unsplittable-overrides"],
)
def test_bad_arguments_are_refused_before_anything_trains(tmp_path, args, message):
    command = [sys.executable, str(Path(distillation_demo.__file__)), "--out", str(tmp_path / "out"), *args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and message in proc.stderr
    assert not (tmp_path / "out").exists()  # no teacher trained, nothing written
