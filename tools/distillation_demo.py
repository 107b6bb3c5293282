"""On-policy distillation against GRPO alone, from the same start: held-out accuracy per round for each.

    python tools/distillation_demo.py                                   # trains the teacher first (the quickstart)
    python tools/distillation_demo.py --teacher runs/teacher/hf         # a teacher folder made earlier
    python tools/distillation_demo.py --teacher-overrides=""            # the quickstart's own 40 rounds teach
    python tools/distillation_demo.py --teacher runs/quickstart/hf --every 2 \\
        --variant "reward + teacher, λ 0.3=--data.rewards '[{name: exact_answer}]' --model.teacher.weight 0.3" \\
        --variant "teacher alone, τ_T 0.5=--model.teacher.temperature 0.5"

1. The teacher: ``--teacher`` (a Hugging Face folder), else ``<out>/teacher/hf`` when a previous call made it, else
   ``configs/quickstart.yaml`` trained into ``<out>/teacher`` and exported with ``tools/export_hf.py``.
   ``--teacher-overrides`` are command-line overrides for that training (split as a shell would split them); by
   default ``"--trainer.max_epochs 160"``: the quickstart trained four times as long, a sharper teacher than its
   40 rounds (docs/distillation.md: A stronger teacher), the teacher ``configs/distillation.yaml`` names. A teacher
   made earlier in ``<out>`` is reused whatever the overrides: give another ``--out`` for another teacher.
2. GRPO alone: ``configs/quickstart.yaml`` (the exact-answer reward, no teacher), and the same at
   ``configs/distillation.yaml``'s sampling (2 samples × 128 prompts a round); ``--no-grpo`` skips both (when an
   earlier call measured them with the same ``--seed`` and ``--rounds``).
3. Distillation: ``configs/distillation.yaml`` (the quickstart with ``model.teacher``) taught by that teacher, and
   each ``--variant "NAME=OVERRIDES"``: the same config with those command-line overrides (split as a shell
   would split them). ``--model.teacher null`` with a reward of weight 1 makes a variant GRPO alone, e.g. at another
   ``data.sampling.group_size`` (docs/distillation.md: Spreading the samples over more prompts).

Every student run is the same: the quickstart's cold-start model, its seed, ``--rounds`` rounds of the same
prompts-per-round and optimizer, and the greedy accuracy on the same 500 held-out prompts after every
``--every`` rounds (``val/accuracy`` in a CSV log under ``<out>/<run>``). The table printed at the end has one row
per run and one column per evaluated round, then the first round each run reached ``--target``. The runs' own
output goes to ``<out>/<run>.log``.
"""

from __future__ import annotations

import argparse
import csv
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fit(config: str, folder: Path, args: list[str], log: Path) -> None:
    """``python -m grpo_lightning fit --config <config> <args>``, its run folder ``folder``, CSV-logged there, with no
    W&B logger, console samples or checkpoints; stdout and stderr to ``log``; a failure stops the demo."""
    command = [sys.executable, "-m", "grpo_lightning", "fit", "--config", config]
    command += ["--trainer.default_root_dir", str(folder), "--trainer.callbacks", "[]"]
    command += ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(folder)]
    command += ["--trainer.logger.name", "logs", "--trainer.logger.version", ""]
    environment = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "offline")}
    with open(log, "w") as out:
        done = subprocess.run([*command, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=environment)
    if done.returncode:
        raise SystemExit(f"{' '.join(command[2:5])} … failed (exit {done.returncode}): see {log}")


def held_out_accuracy(folder: Path) -> dict[int, float]:
    """Round → held-out accuracy (%) from a run's CSV log (a validation after round r is logged at epoch r − 1),
    rounded to 0.1: a count out of 500 prompts, logged in float32 (95% reads 0.9499999881)."""
    with open(folder / "logs" / "metrics.csv", newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("val/accuracy")]
    return {int(float(row["epoch"])) + 1: round(100 * float(row["val/accuracy"]), 1) for row in rows}


def teacher_folder(args: argparse.Namespace) -> Path:
    """The teacher's Hugging Face folder: given, made by an earlier call, or trained now by the quickstart."""
    if args.teacher:
        return Path(args.teacher).resolve()
    run = args.out / "teacher"
    folder = run / "hf"
    if (folder / "config.json").is_file():
        print(f"teacher: {folder} (made earlier)", flush=True)
        return folder
    print(f"teacher: training configs/quickstart.yaml into {run} …", flush=True)
    start = time.monotonic()
    run.mkdir(parents=True, exist_ok=True)
    overrides = ["--trainer.enable_checkpointing", "true", *args.teacher_overrides]
    fit("configs/quickstart.yaml", run, overrides, args.out / "teacher.log")
    checkpoints = sorted((run / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    if not checkpoints:
        raise SystemExit(f"the teacher's run wrote no checkpoint under {run / 'checkpoints'}")
    export = [sys.executable, "tools/export_hf.py", str(checkpoints[-1]), str(folder)]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # a script: no cwd on sys.path
    done = subprocess.run(export, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path})
    if done.returncode:
        raise SystemExit(f"exporting the teacher failed (exit {done.returncode}):\n{done.stdout}{done.stderr}")
    accuracy = held_out_accuracy(run)
    last = f"{accuracy[max(accuracy)]:.1f}% held-out" if accuracy else "not evaluated"
    print(f"teacher: {folder} ({last}, {time.monotonic() - start:.0f} s)", flush=True)
    return folder


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``NAME=OVERRIDES`` → (name, the overrides split as a shell splits them)."""
    name, separator, overrides = text.partition("=")
    if not separator or not name.strip() or not overrides.strip():
        raise SystemExit(f"--variant takes NAME=OVERRIDES, e.g. 'λ 0.3=--model.teacher.weight 0.3' (got {text!r})")
    return name.strip(), shlex.split(overrides)


def first_round(accuracy: dict[int, float], target: float) -> int | None:
    return next((r for r in sorted(accuracy) if accuracy[r] >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", help="the teacher's Hugging Face folder (default: train it with the quickstart)")
    parser.add_argument(
        "--teacher-overrides",
        default="--trainer.max_epochs 160",
        metavar="OVERRIDES",
        help="command-line overrides for the teacher's training (configs/quickstart.yaml), e.g. "
        "'--trainer.max_epochs 160'; ignored with --teacher or a teacher made earlier in --out",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/distillation_demo"), help="where the runs go")
    parser.add_argument("--rounds", type=int, default=20, help="rounds of each student run")
    parser.add_argument("--every", type=int, default=1, help="evaluate the held-out prompts every this many rounds")
    parser.add_argument("--target", type=float, default=95.0, help="held-out accuracy (%%) whose first round is shown")
    parser.add_argument("--seed", type=int, default=0, help="seed_everything and data.seed of every student run")
    parser.add_argument("--no-grpo", action="store_true", help="skip GRPO alone (both samplings)")
    parser.add_argument("--no-distillation", action="store_true", help="skip configs/distillation.yaml's own run")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=OVERRIDES",
        help="another run of configs/distillation.yaml with these command-line overrides (repeatable)",
    )
    args = parser.parse_args()
    if args.rounds < 1 or args.every < 1:
        raise SystemExit(f"--rounds and --every must be >= 1 (got {args.rounds}, {args.every})")
    variants = [parse_variant(text) for text in args.variant]  # refused before anything trains
    try:
        args.teacher_overrides = shlex.split(args.teacher_overrides)
    except ValueError as error:  # an unclosed quote
        raise SystemExit(f"--teacher-overrides: {error} (got {args.teacher_overrides!r})") from None
    if args.no_grpo and args.no_distillation and not variants:
        raise SystemExit("nothing to run: --no-grpo and --no-distillation leave no run; add a --variant")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    teacher = teacher_folder(args)

    schedule = ["--trainer.max_epochs", str(args.rounds), "--trainer.check_val_every_n_epoch", str(args.every)]
    schedule += ["--seed_everything", str(args.seed), "--data.seed", str(args.seed)]  # the data's: prompts, samples
    schedule += ["--trainer.enable_checkpointing", "false"]
    taught = ["--model.teacher.model_name_or_path", str(teacher)]
    runs = []
    if not args.no_grpo:
        runs.append(("GRPO alone (configs/quickstart.yaml)", "grpo", "configs/quickstart.yaml", []))
        split = ["--data.sampling.group_size", "2", "--data.prompts_per_round", "128"]  # configs/distillation.yaml's
        runs.append(("GRPO alone, 2 × 128 (its sampling)", "grpo_2x128", "configs/quickstart.yaml", split))
    if not args.no_distillation:
        runs.append(("configs/distillation.yaml", "distillation", "configs/distillation.yaml", taught))
    for index, (name, overrides) in enumerate(variants, start=1):
        runs.append((name, f"variant{index}", "configs/distillation.yaml", [*taught, *overrides]))

    curves: list[tuple[str, dict[int, float], float]] = []
    for name, folder, config, overrides in runs:
        print(f"{name}: {args.rounds} rounds …", flush=True)
        start = time.monotonic()
        fit(config, args.out / folder, [*schedule, *overrides], args.out / f"{folder}.log")
        accuracy = held_out_accuracy(args.out / folder)
        curves.append((name, accuracy, time.monotonic() - start))
        reached = first_round(accuracy, args.target)
        print(f"  done in {curves[-1][2]:.0f} s; first round at {args.target:g}%: {reached or 'not reached'}")

    rounds = sorted({r for _, accuracy, _ in curves for r in accuracy})
    print(f"\nheld-out greedy accuracy (%, 500 prompts) after each round; teacher {teacher}\n")
    print("| run | " + " | ".join(str(r) for r in rounds) + f" | first round ≥ {args.target:g}% |")
    print("|---|" + "---|" * (len(rounds) + 1))
    for name, accuracy, _ in curves:
        cells = " | ".join(f"{accuracy[r]:.1f}" if r in accuracy else "" for r in rounds)
        print(f"| {name} | {cells} | {first_round(accuracy, args.target) or 'not reached'} |")


if __name__ == "__main__":
    main()
