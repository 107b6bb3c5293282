"""Plot a run's curves to a PNG, from its local logs: four panels (reward, KL, completion length, accuracy per
optimizer step), or with ``--learning-curve`` the held-out accuracy and training reward per round.

    python tools/plot_run.py runs/quickstart                    # newest offline W&B run under the folder
    python tools/plot_run.py runs/quickstart/wandb/offline-run-20250101_120000-abcd1234
    python tools/plot_run.py lightning_logs/version_0 --out curves.png   # a CSVLogger run (metrics.csv)
    python tools/plot_run.py runs/quickstart --learning-curve --title configs/quickstart.yaml

Needs matplotlib (``pip install -e ".[plot]"``). Without ``--out`` the PNG is written next to the logs as
``curves.png`` (``learning_curve.png`` with ``--learning-curve``).

``--learning-curve``: two panels over rounds (round = Lightning's 0-based ``epoch`` + 1; one epoch is one rollout
round): the held-out greedy accuracy ``val/accuracy`` in %, each evaluation's figure written beside its point,
and the training reward ``rollout/reward_mean`` (the mean reward of the round's sampled completions). A metric
logged more than once in a round counts with its last value. ``--title``: the figure's title (default: the run
path as given); the site's figures name their config.

Reproduce the site's figures (docs/assets/; the runs are seeded, so the figures are the README's: quickstart
66.8 / 97.4 / 98.6 / 98.2% at rounds 10 / 20 / 30 / 40, vision 85.7 / 100.0 / 100.0% at rounds 10 / 20 / 30).
configs/vision.yaml logs nothing (``logger: false``), so its run adds a CSV logger on the command line:

    WANDB_MODE=offline python -m grpo_lightning fit --config configs/quickstart.yaml \\
        --trainer.default_root_dir /tmp/plots/quickstart
    python tools/plot_run.py /tmp/plots/quickstart --learning-curve --title configs/quickstart.yaml \\
        --out docs/assets/quickstart_curve.png
    WANDB_MODE=offline python -m grpo_lightning fit --config configs/vision.yaml \\
        --trainer.default_root_dir /tmp/plots/vision \\
        --trainer.logger lightning.pytorch.loggers.CSVLogger --trainer.logger.save_dir /tmp/plots/vision
    python tools/plot_run.py /tmp/plots/vision --learning-curve --title configs/vision.yaml \\
        --out docs/assets/vision_curve.png
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from run_logs import RunLog, find_run, load_run  # tools/run_logs.py, beside this script

HELD_OUT_ACCURACY = "val/accuracy"  # greedy decoding of the held-out split (pass@1), a fraction
TRAINING_REWARD = "rollout/reward_mean"  # mean reward of the round's sampled completions

# Each panel: title, then the metric names it draws (the first is the main curve; names a run lacks are skipped).
CURVES: list[tuple[str, list[str]]] = [
    ("reward", [TRAINING_REWARD, "val/reward_mean"]),
    ("KL to the reference", ["train/kl", "train/kl_step", "train/kl_epoch"]),
    ("completion length (tokens)", ["rollout/completion_length_mean", "val/completion_length_mean"]),
    ("accuracy", [HELD_OUT_ACCURACY, "val/pass@1", "test/accuracy"]),
]


def _pyplot() -> Any:  # matplotlib.pyplot; an optional dependency ("plot" extra), imported on use
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _out_path(run: str | Path, log_file: Path, out: str | Path | None, default_name: str) -> Path:
    """``out``, or ``default_name`` next to the logs: in ``run`` when it is a folder, else beside its log file."""
    if out is not None:
        return Path(out)
    folder = Path(run) if Path(run).is_dir() else log_file.parent
    return folder / default_name


def _with_pass_at_k(log: RunLog, names: list[str]) -> list[str]:
    # pass@k / maj@k keys depend on k: add whichever the run logged to the accuracy panel.
    extra = [key for key in log.keys() if key.startswith(("val/pass@", "val/maj@")) and key not in names]

    def order(key: str) -> tuple[bool, int]:  # pass@1, pass@2, ..., pass@10, then maj@k
        kind, _, k = key.partition("@")
        return kind != "val/pass", int(k) if k.isdigit() else 0

    return names + sorted(extra, key=order)


def plot_run(run: str | Path, out: str | Path | None = None) -> tuple[Path, dict[str, int]]:
    """Render the four panels of ``run`` to ``out``; returns the PNG's path and the points drawn per panel."""
    plt = _pyplot()
    log_file = find_run(run)
    log = load_run(log_file)
    out = _out_path(run, log_file, out, "curves.png")
    figure, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    points: dict[str, int] = {}
    for axis, (title, names) in zip(axes.flat, CURVES):
        if title == "accuracy":
            names = _with_pass_at_k(log, names)
        count = 0
        for name in names:
            steps, values = log.series(name)
            if steps:
                marker = "o" if len(steps) < 30 else None
                axis.plot(steps, values, marker=marker, markersize=3, label=name)
                count += len(steps)
        points[title] = count
        axis.set_title(title)
        axis.set_xlabel("optimizer step")
        axis.grid(alpha=0.3)
        if count:
            axis.legend(fontsize=8)
        else:
            axis.text(0.5, 0.5, "not logged", ha="center", va="center", transform=axis.transAxes, color="gray")
    figure.suptitle(str(log_file), fontsize=8)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out, points


def per_round(log: RunLog, key: str) -> tuple[list[float], list[float]]:
    """(rounds, values) of ``key``: round = the row's 0-based ``epoch`` + 1, the last value logged in a round."""
    last: dict[int, float] = {}
    for row in log.history:
        value = row.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
            continue
        if "epoch" not in row:  # without it a value cannot be placed on a round: say so rather than guess
            raise ValueError(f"{key} is logged in a row without an epoch: cannot place it on a round")
        last[int(row["epoch"]) + 1] = float(value)
    rounds = sorted(last)
    return [float(r) for r in rounds], [last[r] for r in rounds]


def plot_learning_curve(
    run: str | Path, out: str | Path | None = None, title: str | None = None
) -> tuple[Path, dict[str, object]]:
    """Held-out greedy accuracy (%) and training reward per round of ``run``, side by side, to ``out``.

    Returns the PNG's path and what was drawn, read back from the plotted lines: ``accuracy`` and ``reward`` as
    (rounds, values), ``annotations`` (the figures written beside the accuracy points) and ``title``.
    Raises ``ValueError`` when the run logged no ``val/accuracy``.
    """
    log_file = find_run(run)
    log = load_run(log_file)
    accuracy_rounds, accuracy = per_round(log, HELD_OUT_ACCURACY)
    if not accuracy_rounds:
        raise ValueError(f"{log_file}: no {HELD_OUT_ACCURACY} logged (trainer.check_val_every_n_epoch evaluates)")
    reward_rounds, reward = per_round(log, TRAINING_REWARD)
    out = _out_path(run, log_file, out, "learning_curve.png")
    title = str(run) if title is None else title
    last_round = max(accuracy_rounds + reward_rounds)

    plt = _pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(7, 3.5), constrained_layout=True)
    (accuracy_line,) = left.plot(accuracy_rounds, [100 * a for a in accuracy], marker="o", color="tab:blue")
    annotations = []
    points = list(zip(*accuracy_line.get_data()))
    for i, (x, y) in enumerate(points):
        text, final = f"{y:.1f}%", i == len(points) - 1  # the final figure in bold: the run's result
        weight = "bold" if final else "normal"
        left.annotate(text, (x, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8, weight=weight)
        annotations.append(text)
    left.set_ylim(0, 112)  # room above 100% for the figures
    left.set_yticks(range(0, 101, 20))
    left.set_ylabel("held-out greedy accuracy (%)")
    left.set_title("held-out accuracy", fontsize=10)
    (reward_line,) = right.plot(reward_rounds, reward, color="tab:orange", marker="." if len(reward) < 60 else None)
    right.set_ylim(min([0.0, *reward]), max([1.0, *reward]) + 0.05)  # from 0 to 1 unless rewards go beyond
    right.set_ylabel("mean reward (sampled completions)")
    right.set_title("training reward", fontsize=10)
    for axis in (left, right):
        axis.set_xlabel("round")
        axis.set_xlim(0, last_round + 2)  # room for the final figure
        axis.grid(alpha=0.3)
    suptitle = figure.suptitle(title, fontsize=11)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    drawn: dict[str, object] = {
        "accuracy": _xy(accuracy_line),
        "reward": _xy(reward_line),
        "annotations": annotations,
        "title": suptitle.get_text(),
    }
    return out, drawn


def _xy(line: Any) -> tuple[list[float], list[float]]:  # the x and y data of a matplotlib Line2D
    x, y = line.get_data()
    return [float(v) for v in x], [float(v) for v in y]


def main(argv: list[str] | None = None) -> None:
    """Command line: ``plot_run.py RUN [--out PNG] [--learning-curve [--title TEXT]]``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="offline W&B run directory or .wandb file, CSVLogger folder or metrics.csv")
    parser.add_argument("--out", help="PNG to write (default: curves.png or learning_curve.png next to the logs)")
    parser.add_argument(
        "--learning-curve",
        action="store_true",
        help="held-out greedy accuracy (%%) and training reward per round instead of the four panels",
    )
    parser.add_argument("--title", help="the learning curve's title (default: RUN as given)")
    args = parser.parse_args(argv)
    if args.title is not None and not args.learning_curve:
        parser.error("--title is for --learning-curve (the four panels are titled with the log file)")
    if args.learning_curve:
        out, drawn = plot_learning_curve(args.run, args.out, args.title)
        rounds = ", ".join(f"round {r:g}: {text}" for r, text in zip(drawn["accuracy"][0], drawn["annotations"]))
        print(f"wrote {out} (held-out accuracy {rounds}; reward over {len(drawn['reward'][0])} rounds)")
        return
    out, points = plot_run(args.run, args.out)
    print(f"wrote {out} ({', '.join(f'{title}: {n} points' for title, n in points.items())})")


if __name__ == "__main__":
    main()
