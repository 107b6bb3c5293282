"""The calculator demo's rollout time per round and its figures, for this checkout and (``--baseline``) another.

    python tools/bench_multiturn.py                                  # this checkout: the demo, rollout s/round
    git worktree add /tmp/kv_base HEAD~1 && python tools/bench_multiturn.py --baseline /tmp/kv_base
    python tools/bench_multiturn.py --rounds 5 --val-limit 100       # a shorter window (figures of that window)

Each run is a fresh subprocess that runs the demo as ``tools/calculator_demo.py`` does (the checkout's
``configs/tools_calculator.yaml``): the held-out accuracy of the starting model, ``fit`` for ``--rounds`` rounds,
the held-out accuracy after. It reports each round's rollout seconds (``time/generate``: sampling the
trajectories, the environment's steps included; and the whole rollout, every ``time/`` phase of it: scoring and
π_ref's pass too, and ``time/environment`` only inside generate, which holds it) and the demo's figures: each
round's mean reward and the held-out accuracies before and after.

``--baseline DIR`` adds the same runs on another checkout (its package first on the path; this script's child runs
on it), alternated with ours in one rotation (a shared CPU's speed drifts by 10-20% within minutes: versions timed
at different times cannot be compared). Each run also reports the rollout's CPU seconds, which on a busy machine
at ``--threads 1`` vary less than wall times; ``--json PATH`` keeps every round's numbers. The last two lines:

    rollout ours/baseline: generate <ours/base> (<base/ours>x faster), rollout ..., rollout CPU seconds ...
    figures: identical to the digit (rewards of <rounds> rounds .3f, accuracies .1%): yes|no; bit for bit: yes|no
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
from pathlib import Path
from typing import Any

from lightning import Callback, LightningModule, Trainer

ROOT = Path(__file__).resolve().parents[1]


class RoundFigures(Callback):
    """Each round's rollout timings and mean reward (the rollout batch's metrics), kept in ``rounds``; also the
    process's CPU seconds of the rollout (it runs when the round's first batch is fetched), which a busy machine
    disturbs less than the wall time at one thread."""

    def __init__(self) -> None:
        self.rounds: list[dict[str, float]] = []
        self._cpu_start: float | None = None
        self._rollout_cpu = float("nan")

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._cpu_start = time.process_time()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._cpu_start is not None:  # the round's first batch: its rollout has just run
            self._rollout_cpu, self._cpu_start = time.process_time() - self._cpu_start, None

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from grpo_lightning.rollout.datamodule import latest_rollout  # the package of the side being measured

        metrics = latest_rollout(trainer).metrics
        phases = {k: float(v) for k, v in metrics.items() if k.startswith("time/") and not k.endswith("_per_s")}
        # ``time/environment`` is the part of ``time/generate`` spent in the environment: counted once, in generate.
        environment = phases.pop("time/environment", 0.0)
        self.rounds.append(
            {
                "generate_s": phases.get("time/generate", float("nan")),
                "environment_s": environment,
                "rollout_s": sum(phases.values()),
                "rollout_cpu_s": self._rollout_cpu,
                "reward": float(metrics["rollout/reward_mean"]),
            }
        )


def run_demo(root: Path, rounds: int, val_limit: int, folder: Path) -> dict[str, Any]:
    """The demo of checkout ``root`` in this process (the child, on that checkout's package): accuracy before,
    ``fit``, accuracy after, and each round's figures."""
    import bench_multiturn  # this file as a module: the callback class the CLI instantiates by name
    import wandb

    from grpo_lightning.cli import GRPOCLI

    asset = root / "grpo_lightning" / "assets" / "tiny-calc"
    common = ["--config", str(root / "configs" / "tools_calculator.yaml"), "--model.model_name_or_path", str(asset)]
    common += ["--data.eval.limit", str(val_limit), "--trainer.default_root_dir", str(folder)]
    quiet = ["--trainer.enable_progress_bar", "false"]

    def accuracy(cli: GRPOCLI) -> float:
        return float(cli.trainer.callback_metrics["val/accuracy"])

    before = accuracy(GRPOCLI(args=["validate", *common, *quiet]))
    fit = GRPOCLI(
        args=[
            "fit",
            *common,
            *quiet,
            "--trainer.max_epochs",
            str(rounds),
            "--trainer.check_val_every_n_epoch",
            "1000",
            "--trainer.callbacks+=bench_multiturn.RoundFigures",
        ]
    )
    wandb.finish()
    figures = next(c for c in fit.trainer.callbacks if isinstance(c, bench_multiturn.RoundFigures))
    last = Path(fit.trainer.default_root_dir) / "checkpoints" / "last.ckpt"
    after = accuracy(GRPOCLI(args=["validate", *common, *quiet, "--ckpt_path", str(last)]))
    return {"before": before, "after": after, "rounds": figures.rounds}


def run_child(side: str, args: argparse.Namespace, baseline: Path | None) -> dict[str, Any]:
    """One run of the demo in a fresh interpreter, on ours or on ``baseline``'s package."""
    env = {**os.environ, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    # The child imports this file as ``bench_multiturn`` (the callback) and, first, the side's package.
    root = baseline if side == "baseline" and baseline else ROOT
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    if args.threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        cmd = [sys.executable, __file__, "--child", folder, "--root", str(root), "--rounds", str(args.rounds)]
        cmd += ["--val-limit", str(args.val_limit)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
        raise RuntimeError(f"the {side} run failed (exit {proc.returncode})")
    return json.loads(lines[-1][len("RESULT ") :])


def figures(result: dict[str, Any]) -> list[str]:
    """The demo's figures as it prints them: each round's mean reward (``.3f``), the accuracies (``.1%``)."""
    return [f"{r['reward']:.3f}" for r in result["rounds"]] + [f"{result['before']:.1%}", f"{result['after']:.1%}"]


def exact(result: dict[str, Any]) -> list[float]:
    """The same figures as floats: equal ones are equal bit for bit."""
    return [r["reward"] for r in result["rounds"]] + [result["before"], result["after"]]


def per_round(result: dict[str, Any], key: str) -> float:
    """The mean of ``key`` (``generate_s``, ``rollout_s``) over the run's rounds."""
    return statistics.fmean(r[key] for r in result["rounds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30, help="rounds of fit (the demo's: 30)")
    parser.add_argument("--val-limit", type=int, default=500, help="held-out prompts (the demo's: 500)")
    parser.add_argument("--runs", type=int, default=1, help="runs per side, alternated (median of their means)")
    parser.add_argument("--threads", type=int, help="CPU threads per run (default: torch's default)")
    parser.add_argument("--baseline", type=Path, help="another checkout of grpo_lightning, in the same rotation")
    parser.add_argument("--json", type=Path, help="write every run's figures and per-round seconds to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = run_demo(args.root, args.rounds, args.val_limit, Path(args.child))
        print("RESULT " + json.dumps(result), flush=True)
        return
    baseline = args.baseline.resolve() if args.baseline else None
    if baseline and not (baseline / "grpo_lightning" / "assets" / "tiny-calc" / "config.json").is_file():
        parser.error(
            f"--baseline {baseline} is not a checkout of grpo_lightning: make one with git worktree add DIR REV"
        )
    sides = ["ours"] + (["baseline"] if baseline else [])
    results: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for run in range(args.runs):
        shift = run % len(sides)  # rotate which side goes first, so that load drifts hit both alike
        for side in sides[shift:] + sides[:shift]:
            load = os.getloadavg()[0]
            result = run_child(side, args, baseline)
            results[side].append(result)
            print(
                f"run {run + 1} {side:>8}: generate {per_round(result, 'generate_s'):.3f} s/round, rollout "
                f"{per_round(result, 'rollout_s'):.3f} s/round (CPU {per_round(result, 'rollout_cpu_s'):.3f}), "
                f"reward last round {figures(result)[-3]}, accuracy "
                f"{figures(result)[-2]} -> {figures(result)[-1]} (load {load:.2f} before)",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    keys = ("generate_s", "rollout_s", "rollout_cpu_s")
    median = {
        side: {key: statistics.median(per_round(r, key) for r in runs) for key in keys}
        for side, runs in results.items()
    }
    print(
        f"\n{args.rounds} rounds, {args.val_limit} held-out prompts, {args.runs} run(s) per side, {os.cpu_count()} CPUs"
    )
    for side, values in median.items():
        print(
            f"{side}: generate {values['generate_s']:.3f} s/round, rollout {values['rollout_s']:.3f} s/round "
            f"(CPU {values['rollout_cpu_s']:.3f} s/round)"
        )
    if not baseline:
        return
    # Each run's pair (adjacent in time, so under about the same load): how many times faster ours ran.
    pairs = {
        key: [per_round(b, key) / per_round(o, key) for o, b in zip(results["ours"], results["baseline"])]
        for key in keys
    }
    print(
        "paired runs, baseline/ours: "
        + "; ".join(f"{key} " + " ".join(f"{x:.2f}" for x in pairs[key]) for key in keys)
        + " (medians "
        + ", ".join(f"{statistics.median(pairs[key]):.2f}x" for key in keys)
        + ")"
    )
    ours, base = median["ours"], median["baseline"]
    print(
        f"rollout ours/baseline: generate {ours['generate_s'] / base['generate_s']:.2f} "
        f"({base['generate_s'] / ours['generate_s']:.2f}x faster), rollout {ours['rollout_s'] / base['rollout_s']:.2f} "
        f"({base['rollout_s'] / ours['rollout_s']:.2f}x faster); rollout CPU seconds "
        f"{ours['rollout_cpu_s'] / base['rollout_cpu_s']:.2f} ({base['rollout_cpu_s'] / ours['rollout_cpu_s']:.2f}x)"
    )
    printed = all(figures(r) == figures(results["baseline"][0]) for rs in results.values() for r in rs)
    bits = all(exact(r) == exact(results["baseline"][0]) for rs in results.values() for r in rs)
    print(
        f"figures: identical to the digit (rewards of {args.rounds} rounds .3f, accuracies .1%): "
        f"{'yes' if printed else 'no'}; bit for bit: {'yes' if bits else 'no'}"
    )
    if not printed:
        for side, runs in results.items():
            print(f"{side}: " + " ".join(figures(runs[0])))


if __name__ == "__main__":
    main()
