"""Shared fixtures: tiny models and tokenizers built in code (nothing is downloaded)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# One intra-op thread for the whole suite, set before torch is imported: tests fork training processes
# (test_crash), and a child forked after torch's OpenMP pool has started can deadlock; the tiny models gain
# nothing from threads, and subprocess tests don't oversubscribe the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# No test times anything: CPU products stay plain here and in every process a test starts
# (models/cpu_packing_rule.py); the tests of the packing inject timings instead of measuring.
os.environ["GRPO_LIGHTNING_CPU_PACKING"] = "off"

# tools/ holds the measurement helpers some tests use (memory_probe, run_logs): importable by their names.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

# The tests are laid out like the package, a folder per room (docs/development.md). A test file reuses what another
# defines by module name (``from test_resume import fit``), and runs started by a test import test files by name
# too (a reward ``test_async_kill.counting_reward``, a script run by torchrun importing ``helpers``): every folder
# is importable here and in every process a test starts.
TEST_FOLDERS = [str(Path(__file__).resolve().parent)]
TEST_FOLDERS += [str(p) for p in sorted(Path(TEST_FOLDERS[0]).iterdir()) if p.is_dir() and any(p.glob("test_*.py"))]
sys.path[1:1] = [folder for folder in TEST_FOLDERS if folder not in sys.path]
os.environ["PYTHONPATH"] = os.pathsep.join([*TEST_FOLDERS, *filter(None, [os.environ.get("PYTHONPATH")])])

import pytest  # noqa: E402
import torch  # noqa: E402

from grpo_lightning.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_llama  # noqa: E402

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=64)

# The files that take longest (each 35 s to nearly 3 minutes on the 2-core CI machine: several processes, whole
# runs), longest first. They start first, so that the two workers of ``-n 2 --dist loadfile
# --no-loadscope-reorder`` (pyproject) end together: xdist's own order (most tests first) leaves these few-test
# files to the end, where one worker can be left running the last long file alone.
SLOW_FIRST = (
    "test_strategies_presets.py",
    "test_async_rollouts.py",
    "test_async_kill.py",
    "test_determinism.py",
    "test_cli.py",
    "test_bad_inputs.py",
    "test_distributed.py",
    "test_rollout_metrics_ddp.py",
    "test_vision_lag_resume.py",
    "test_held_out_ranks.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow files first (``SLOW_FIRST``); the rest keep pytest's order (the sort is stable)."""
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))


@pytest.fixture
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def tiny_llama(tokenizer):
    torch.manual_seed(0)
    return build_tiny_llama(TINY, tokenizer).eval()


@pytest.fixture
def tiny_model_dir(tmp_path, tokenizer, tiny_llama):
    """A tiny model and tokenizer saved as a Hugging Face folder, loaded back through model_name_or_path."""
    path = tmp_path / "tiny-model"
    tiny_llama.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def quiet_trainer(root, **overrides):
    """A CPU Trainer with GRPO's defaults and no logger, checkpoints, progress bar, summary or validation."""
    from lightning import Trainer

    from grpo_lightning.cli import TRAINER_DEFAULTS

    settings = {
        **TRAINER_DEFAULTS,
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "limit_val_batches": 0,
        "default_root_dir": root,
    }
    return Trainer(**{**settings, **overrides})
