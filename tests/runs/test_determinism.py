"""Reproducibility at the default thread count: identical quickstart runs end with identical weights, bit for bit,
and so do 3 + 3 rounds and 6.

The rest of the suite runs single-threaded (``conftest.py`` sets ``OMP_NUM_THREADS=1``), where kernels that add
in parallel in a varying order (atomic adds) cannot show it. These fits run as a user's do: in their own
processes, with two intra-op threads. Before the fix, the backward of the lean forward's shared prompt keys and
values (``x[inverse]``: parallel atomic adds on CPU) made two such runs differ in the last bits from the first
optimizer step on (see ``grpo_lightning.models.lean_forward._repeat_rows``).

The rounds are the quickstart's own (32 prompts × 8 completions): smaller rounds (8 prompts) were measured not
to reach the parallel kernels, and a test on them passed on the code before the fix. Two fits run side by side.

At a rollout lag (``data.schedule.rollout_lag: 1``) the two default threads are split, one for the background
sampler and one for the update: ``test_async_kill.py`` runs its fits at the default threads, each resumed run against an
uninterrupted one (lag 2's schedule, the same at any thread count, is resumed exactly in ``test_async_rollouts.py``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# Two threads per fit, as on a 2-core machine by default. Passive waiting: with two fits side by side, threads
# spinning at OpenMP barriers would slow them down severalfold; it changes no kernel and no split of the work.
THREADS = {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
LAST = Path("runs/quickstart/checkpoints/last.ckpt")  # where the quickstart's RoundCheckpoint writes, under cwd


def start_fit(cwd: Path, rounds: int, *args: str) -> subprocess.Popen:
    """The quickstart at 2 threads, ``rounds`` rounds, seed 7, no logger; checkpoints under ``cwd``."""
    cwd.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **THREADS, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    command = [
        sys.executable,
        "-m",
        "grpo_lightning",
        "fit",
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--model.model_name_or_path",
        str(ROOT / "grpo_lightning/assets/tiny-arith"),
        "--seed_everything",
        "7",
        "--trainer.max_epochs",
        str(rounds),
        "--trainer.logger",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        *args,
    ]
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(*fits: subprocess.Popen) -> None:
    for fit in fits:
        output, _ = fit.communicate(timeout=300)
        assert fit.returncode == 0, output[-3000:]


def policy_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    return {name: value for name, value in state.items() if name.startswith("policy.")}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    differ = {name: (a[name] - b[name]).abs().max().item() for name in a if not torch.equal(a[name], b[name])}
    assert not differ, f"{len(differ)} of {len(a)} tensors differ, up to {max(differ.values()):.3g}: {sorted(differ)}"


# The 6-round fit also saves its round 3, which the 3-round fit beside it must equal.
ROUND_3 = """
trainer:
  callbacks:
    - class_path: grpo_lightning.callbacks.RoundCheckpoint
      init_args: {filename: "round{round:03d}", every_n_rounds: 3, save_top_k: -1}
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 3-round fit and a 6-round one (saving its round 3), side by side."""
    root = tmp_path_factory.mktemp("determinism")
    (root / "round3.yaml").write_text(ROUND_3)
    finish(start_fit(root / "a", 3), start_fit(root / "six", 6, "--config", str(root / "round3.yaml")))
    shutil.copy(root / "a" / LAST, root / "a-round3.ckpt")  # the resume below writes a newer last.ckpt
    return root


def test_two_identical_fits_end_with_identical_weights(runs):
    """The same 3 rounds in two processes (the second fit's round 3: the run lengths change no round before)."""
    six_round_3 = runs / "six" / LAST.parent / "round003.ckpt"
    assert_same_weights(policy_weights(runs / "a-round3.ckpt"), policy_weights(six_round_3))


def test_three_rounds_then_three_more_equal_six_rounds_at_two_threads(runs):
    finish(start_fit(runs / "a", 6, "--ckpt_path", "last"))
    assert_same_weights(policy_weights(runs / "a" / LAST), policy_weights(runs / "six" / LAST))
