"""The benchmarks say what they ran on (issue 55 point 3): beside every table, the CPU model, the instruction set torch
dispatches to, the thread count, torch's version, and what our side's CPU packing measured on that machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))

import bench_trl  # noqa: E402

from grpo_lightning.models import cpu_packing_rule  # noqa: E402


def test_the_environment_lines_name_the_machine():
    lines = bench_trl.environment(threads=3).splitlines()
    assert lines[0].startswith("environment: torch ")
    machine = lines[1]
    assert machine.startswith(f"machine: CPU {cpu_packing_rule.cpu_model()}, ")
    assert f"torch dispatches to {cpu_packing_rule.instruction_set()}, 3 threads, torch {torch.__version__}" in machine
    assert f"{torch.get_num_threads()} threads" in bench_trl.environment().splitlines()[1]  # torch's default


def test_a_runs_packing_report_is_printed_and_left_out_of_the_medians():
    runs = [
        {"s_per_step": 1.0, "peak_rss_mb": 10.0, "cpu_packing": ["decode at 32 rows, 512 wide: qkv 0.50x"]},
        {"s_per_step": 3.0, "peak_rss_mb": 30.0, "cpu_packing": []},
    ]
    assert bench_trl.median_result(runs) == {"s_per_step": 2.0, "peak_rss_mb": 20.0}
    assert bench_trl.packing_report(runs[0]) == "  decode at 32 rows, 512 wide: qkv 0.50x"
    assert "nothing measured" in bench_trl.packing_report(runs[1])
    assert bench_trl.packing_report({"s_per_step": 1.0}) == "  (not reported)"  # a baseline older than the rule
    assert bench_trl.with_packing_report({"s_per_step": 1.0})["cpu_packing"] == cpu_packing_rule.describe()


def test_bench_distill_refuses_a_baseline_that_is_not_a_checkout(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(TOOLS / "bench_distill.py"), "--baseline", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert f"--baseline {tmp_path} has no tools/bench_distill.py" in proc.stderr.splitlines()[-1]
