"""How one GRPO step of grpo_lightning scales with the group size G and the completion length, on CPU.

    python tools/bench_scaling.py                        # G = 4, 8, 16 × 16, 64, 256 new tokens
    python tools/bench_scaling.py --groups 4 8 --tokens 16 64 --steps 1 2

The model, prompts and reward are those of ``tools/bench_trl.py``'s settings A (0.67M parameters, 8 prompts of 6
tokens per step, β = 0.04, μ = 1); completions have a fixed length (EOS forbidden before ``max_new_tokens``).
Each cell runs our public API (GRPOModule + RolloutDataModule + Trainer) for a few warm-up steps, then times the
next steps. The table gives seconds per optimizer step, the part of it spent generating, and both divided by
the completion tokens of the step (prompts × G × tokens): flat or falling per-token columns mean the step grows
no faster than linearly in G × tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_trl, next to this file

from bench_trl import SETTINGS, build_assets, make_ours  # noqa: E402


def measure(folder: Path, group_size: int, new_tokens: int, warmup: int, measured: int) -> dict[str, float]:
    """Seconds per optimizer step, and generation seconds per step, over ``measured`` steps after ``warmup``."""
    import lightning as L

    settings = replace(
        SETTINGS["A"], group_size=group_size, new_tokens=new_tokens, warmup_steps=warmup, measured_steps=measured
    )
    stamps: list[float] = []
    generate: list[float] = []

    class Timer(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            stamps.append(time.perf_counter())  # μ = 1, one mini-batch: one batch = one step = one round
            # The round's rollout ran when this (its only) batch was fetched.
            generate.append(trainer.datamodule.last_rollout.metrics["time/generate"])

    module, data, trainer = make_ours(settings, folder, [Timer()])
    trainer.fit(module, datamodule=data)
    window = slice(warmup, warmup + measured)
    step = (stamps[warmup + measured - 1] - stamps[warmup - 1]) / measured
    return {"step": step, "generate": sum(generate[window]) / measured, "tokens": settings.prompts * group_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", nargs="+", type=int, default=[4, 8, 16])
    parser.add_argument("--tokens", nargs="+", type=int, default=[16, 64, 256])
    parser.add_argument("--steps", nargs=2, type=int, default=[2, 3], metavar=("WARMUP", "MEASURED"))
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_assets(SETTINGS["A"], folder)
        for group_size in args.groups:
            for new_tokens in args.tokens:
                load = os.getloadavg()[0]
                result = measure(folder, group_size, new_tokens, *args.steps)
                completion_tokens = result["tokens"] * new_tokens
                rows.append((group_size, new_tokens, completion_tokens, result, load))
                print(f"G={group_size} tokens={new_tokens}: {result['step']:.3f} s/step (load {load:.2f})", flush=True)

    print(
        "\n| G | new tokens | completion tokens / step | s / step | generate s / step "
        "| µs / completion token (step) | µs / completion token (generate) |"
    )
    print("|---|---|---|---|---|---|---|")
    for group_size, new_tokens, tokens, result, _ in rows:
        print(
            f"| {group_size} | {new_tokens} | {tokens} | {result['step']:.3f} | {result['generate']:.3f} "
            f"| {1e6 * result['step'] / tokens:.0f} | {1e6 * result['generate'] / tokens:.0f} |"
        )
    loads = [load for *_, load in rows]
    print(f"\n(1-minute load average during the runs: {min(loads):.2f} to {max(loads):.2f})")


if __name__ == "__main__":
    main()
