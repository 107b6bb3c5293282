"""Asynchronous rollouts, measured: a round at ``data.schedule.rollout_lag: 1`` against the two halves it overlaps.

    python tools/bench_async.py                  # bench_trl's settings B with μ = 1, β = 0; 3 runs of each row
    python tools/bench_async.py --settings A --runs 5
    python tools/bench_async.py --device cuda     # on a GPU (the background process on the same device)

Rows, each run in a fresh subprocess (rotated, so that the machine's drift hits every row alike):

- ``lag 0, 2 threads``: today's round, generate then update, at torch's default on a 2-core machine;
- ``lag 1, 1 + 1 threads``: the background process generates with one thread while the update runs on the other
  (``data.schedule.rollout_threads: 1``; the update keeps the rest of this process's 2).

Per run, over the measured rounds (after the warm-up rounds): seconds per round (wall time from one round's start
to the next's) and the means of the round's own ``time/generate`` (the background process's at lag 1),
``time/update`` (first to last micro-batch), ``time/logprobs`` (π_prox and π_ref) and ``time/wait`` (how long the
update waited for the background; lag 1 only). The last line, ``overlap=R``, is the lag-1 rows' median of
s_per_round / (time/generate + time/update) of the same run: 1 = nothing overlapped, 0.5 = two equal halves fully
overlapped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_trl import SETTINGS, Settings, build_assets, make_ours  # noqa: E402

ROWS = {"lag0": (0, 2, None), "lag1": (1, 2, 1)}  # name: (rollout lag, OMP threads of the run, rollout threads)


def run(settings: Settings, folder: Path, lag: int, rollout_threads: int | None, rounds: tuple[int, int]) -> dict:
    """One measured fit in this process; per-round wall times and the rollout's timings."""
    import lightning as L

    from grpo_lightning import ScheduleConfig

    warmup, measured = rounds
    starts: list[float] = []
    per_round: list[dict[str, float]] = []

    class Rounds(L.Callback):
        def on_train_epoch_start(self, trainer: L.Trainer, module: Any) -> None:
            starts.append(time.perf_counter())
            self.first = self.last = None

        def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, index: int) -> None:
            self.first = self.first or time.perf_counter()

        def on_train_batch_end(self, trainer: L.Trainer, module: Any, *args: Any) -> None:
            self.last = time.perf_counter()

        def on_train_epoch_end(self, trainer: L.Trainer, module: Any) -> None:
            metrics = trainer.datamodule.last_rollout.metrics
            timings = {k: metrics.get(f"time/{k}", 0.0) for k in ("generate", "score", "logprobs", "wait")}
            per_round.append({**timings, "update": self.last - self.first})

    # One optimizer step per pass over the rollout (mini-batch = rollout): μ steps a round; one round more than
    # measured, as the last measured round ends when the next one starts.
    settings = replace(settings, warmup_steps=warmup * settings.mu, measured_steps=(measured + 1) * settings.mu)
    schedule = ScheduleConfig(rollout_lag=lag, rollout_threads=rollout_threads)
    module, data, trainer = make_ours(settings, folder, [Rounds()], schedule=schedule)
    trainer.fit(module, datamodule=data)
    window = slice(warmup, warmup + measured)
    seconds = [b - a for a, b in zip(starts[window], starts[warmup + 1 : warmup + measured + 1])]
    means = {k: statistics.mean(r[k] for r in per_round[window]) for k in per_round[0]}
    return {"s_per_round": statistics.mean(seconds), **means}


def run_child(
    row: str, name: str, folder: Path, rounds: tuple[int, int], device: str, overrides: list[str]
) -> dict[str, float]:
    lag, threads, rollout_threads = ROWS[row]
    env = {**os.environ, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "GRPO_BENCH_DEVICE": device}
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, __file__, "--child", row, "--settings", name, "--assets", str(folder)]
    cmd += ["--rounds", *map(str, rounds), *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
        raise RuntimeError(f"the {row} run failed (exit {proc.returncode})")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default="B", choices=list(SETTINGS))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", nargs=2, type=int, default=(2, 6), metavar=("WARMUP", "MEASURED"))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    # B's model and rollout, with μ = 1 and β = 0 (DAPO's and Dr. GRPO's choice): then a round's update is one
    # optimizer step with no log-prob pass before it, and at one thread each generation and update take comparable
    # time (measured: 2.7 s and 4.2 s), which is where an overlap can show. --mu 2 --beta 0.04 is B itself.
    parser.add_argument("--mu", type=int, default=1, help="μ, passes over each rollout (default 1; B has 2)")
    parser.add_argument("--beta", type=float, default=0.0, help="β (default 0: no reference pass; B has 0.04)")
    parser.add_argument("--new-tokens", type=int, help="override the settings' completion length")
    parser.add_argument("--child", choices=list(ROWS), help=argparse.SUPPRESS)
    parser.add_argument("--assets", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    settings = SETTINGS[args.settings]
    overrides = {"mu": args.mu, "beta": args.beta, "new_tokens": args.new_tokens}
    settings = replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    if args.child:
        lag, _, rollout_threads = ROWS[args.child]
        result = run(settings, args.assets, lag, rollout_threads, tuple(args.rounds))
        print("RESULT " + json.dumps(result), flush=True)
        return

    passed = [f"--{k.replace('_', '-')}={v}" for k, v in overrides.items() if v is not None]
    results: dict[str, list[dict[str, float]]] = {row: [] for row in ROWS}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_assets(settings, folder)
        for run_index in range(args.runs):
            order = list(ROWS) if run_index % 2 == 0 else list(reversed(ROWS))
            for row in order:
                loads.append(os.getloadavg()[0])
                result = run_child(row, args.settings, folder, tuple(args.rounds), args.device, passed)
                results[row].append(result)
                print(f"run {run_index + 1} {row}: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()), flush=True)
    s = settings
    print(
        f"\nsettings {args.settings}: hidden {s.hidden}, {s.layers} layers, {s.prompts}×G={s.group_size}, "
        f"{s.new_tokens} new tokens, μ={s.mu}, β={s.beta}; rounds {args.rounds[0]} warm-up + {args.rounds[1]} "
        f"measured; median of {args.runs} runs; load {min(loads):.2f}-{max(loads):.2f} on {os.cpu_count()} CPUs"
    )
    columns = "s/round | time/generate | time/update | time/logprobs | time/wait | s/round ÷ (generate + update)"
    print(f"\n| row | {columns} |")
    print("|---|---|---|---|---|---|---|")
    for row, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        ratio = statistics.median(r["s_per_round"] / (r["generate"] + r["update"]) for r in runs)
        lag, threads, rollout_threads = ROWS[row]
        split = f"{rollout_threads} + {threads - rollout_threads}" if lag else f"{threads}"
        label = f"lag {lag}, {split} threads"
        print(
            f"| {label} | {med['s_per_round']:.3f} | {med['generate']:.3f} | {med['update']:.3f} | "
            f"{med['logprobs']:.3f} | {med['wait']:.3f} | {ratio:.2f} |"
        )
    overlap = statistics.median(r["s_per_round"] / (r["generate"] + r["update"]) for r in results["lag1"])
    speedup = statistics.median(r["s_per_round"] for r in results["lag0"]) / statistics.median(
        r["s_per_round"] for r in results["lag1"]
    )
    print(f"\noverlap={overlap:.2f} lag1_vs_lag0_wall={1 / speedup:.2f}")


if __name__ == "__main__":
    main()
