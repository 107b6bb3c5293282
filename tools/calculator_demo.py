"""The tool-calling demo end to end: held-out accuracy before GRPO, the multi-turn GRPO run, accuracy after.

    python tools/calculator_demo.py [--config configs/tools_calculator.yaml] [extra CLI overrides ...]

Runs ``validate`` on the starting model (``grpo_lightning/assets/tiny-calc``; made by
``tools/make_calculator_model.py`` when missing), ``fit``, and ``validate`` on the final checkpoint, all with the
same config, and prints the greedy held-out accuracy before → after, with the wall time of each stage.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import wandb

from grpo_lightning.cli import GRPOCLI

ROOT = Path(__file__).resolve().parents[1]


def accuracy(cli: GRPOCLI) -> float:
    return float(cli.trainer.callback_metrics["val/accuracy"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "tools_calculator.yaml"))
    args, overrides = parser.parse_known_args()
    asset = ROOT / "grpo_lightning" / "assets" / "tiny-calc"
    if not (asset / "model.safetensors").is_file():  # a clean clone ships it; rebuild if it was deleted
        subprocess.run(
            [sys.executable, str(ROOT / "tools" / "make_calculator_model.py"), "--out", str(asset)], check=True
        )
    common = ["--config", args.config, "--model.model_name_or_path", str(asset), *overrides]
    quiet = ["--trainer.enable_progress_bar", "false"]

    start = time.perf_counter()
    before = accuracy(GRPOCLI(args=["validate", *common, *quiet]))
    validated = time.perf_counter()
    fit = GRPOCLI(args=["fit", *common, "--trainer.check_val_every_n_epoch", "1000"])
    wandb.finish()
    last = Path(fit.trainer.default_root_dir) / "checkpoints" / "last.ckpt"
    trained = time.perf_counter()
    after = accuracy(GRPOCLI(args=["validate", *common, *quiet, "--ckpt_path", str(last)]))
    end = time.perf_counter()
    print(
        f"\nheld-out greedy accuracy: {before:.1%} (starting model) -> {after:.1%} (after GRPO), "
        f"{100 * (after - before):+.1f} points\n"
        f"wall time: validate {validated - start:.0f}s, fit {trained - validated:.0f}s, "
        f"validate {end - trained:.0f}s, total {end - start:.0f}s"
    )


if __name__ == "__main__":
    main()
