"""The benchmark scripts still run (their figures are measured by hand, not in tests): tiny windows, our side."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_trl  # noqa: E402


def test_bench_trl_times_our_steps(tmp_path):
    settings = replace(bench_trl.SETTINGS["A"], warmup_steps=1, measured_steps=2)
    bench_trl.build_assets(settings, tmp_path)
    result = bench_trl.run_ours(settings, tmp_path)
    assert set(result) == {"s_per_step", "cpu_s_per_step", "peak_rss_mb"}
    assert result["s_per_step"] > 0 and result["peak_rss_mb"] > 100


def test_bench_trl_times_trl_steps_when_installed(tmp_path):
    pytest.importorskip("trl")
    settings = replace(bench_trl.SETTINGS["A"], warmup_steps=1, measured_steps=2)
    bench_trl.build_assets(settings, tmp_path)
    result = bench_trl.run_trl(settings, tmp_path)
    assert result["s_per_step"] > 0


def test_bench_trl_baseline_runs_the_other_checkouts_code(tmp_path):
    """``--baseline DIR``: the child runs DIR's script on DIR's package (ahead of the installed one)."""
    root = Path(__file__).resolve().parents[2]
    base = tmp_path / "base"
    shutil.copytree(root / "grpo_lightning", base / "grpo_lightning", ignore=shutil.ignore_patterns("__pycache__"))
    (base / "tools").mkdir()
    script = (root / "tools" / "bench_trl.py").read_text()
    # The copy tells which package its child imported: its own, marked, or the installed one.
    (base / "grpo_lightning" / "__init__.py").write_text(
        (root / "grpo_lightning" / "__init__.py").read_text() + "\nBASELINE_MARK = True\n"
    )
    marked = 'result = {**result, "marked": getattr(__import__("grpo_lightning"), "BASELINE_MARK", False)}'
    script = script.replace('    print("RESULT "', f"    {marked}\n" + '    print("RESULT "', 1)
    (base / "tools" / "bench_trl.py").write_text(script)
    settings = replace(bench_trl.SETTINGS["A"], warmup_steps=1, measured_steps=2)
    bench_trl.build_assets(settings, tmp_path / "assets")
    result = bench_trl.run_child("baseline", "A", settings, tmp_path / "assets", threads=1, baseline=base)
    assert result["marked"] is True and result["s_per_step"] > 0


def test_bench_trl_refuses_a_baseline_that_is_not_a_checkout(tmp_path):
    script = Path(__file__).resolve().parents[2] / "tools" / "bench_trl.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--baseline", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert f"--baseline {tmp_path} has no tools/bench_trl.py" in proc.stderr.splitlines()[-1]


# ------------------------------------------------------------------------------------------ bench_math_reward
def test_bench_math_reward_runs_on_the_sample_files(capsys):
    import bench_math_reward

    data = Path(__file__).parents[1] / "data"
    rows = [json.loads(line) for line in (data / "math_sample.jsonl").open()]
    cases = bench_math_reward.math_cases(rows)
    assert {expected for _, _, expected in cases} == {0.0, 1.0}
    assert ("So the answer is $\\boxed{-10}$.", "10", 0.0) in cases  # a sign flip among the wrong answers
    bench_math_reward.main([str(data / "gsm8k_sample.jsonl"), "--math", str(data / "math_sample.jsonl"),
                            "--backends", "builtin"])  # fmt: skip
    lines = [line for line in capsys.readouterr().out.splitlines() if "| builtin |" in line]
    # GSM8K sample, MATH sample, the hand-written table: no wrong answer rewarded, no right one missed.
    assert len(lines) == 3 and all("| 100.00% | 0 / " in line for line in lines)
    assert all(re.search(r"\| 0 / \d+ \| 0 / \d+ \| [\d.]+ \|$", line) for line in lines)
