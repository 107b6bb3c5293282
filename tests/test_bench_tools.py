"""The benchmark scripts still run (their figures are measured by hand, not in tests): tiny windows, our side."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

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
