"""Plot a run's reward, KL, completion length and accuracy curves to one PNG, from its local logs.

    python tools/plot_run.py runs/quickstart                    # newest offline W&B run under the folder
    python tools/plot_run.py runs/quickstart/wandb/offline-run-20250101_120000-abcd1234
    python tools/plot_run.py lightning_logs/version_0 --out curves.png   # a CSVLogger run (metrics.csv)

Needs matplotlib (``pip install -e ".[plot]"``). Without ``--out`` the PNG is written next to the logs as
``curves.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from run_logs import RunLog, find_run, load_run  # tools/run_logs.py, beside this script

# Each panel: title, then the metric names it draws (the first is the main curve; names a run lacks are skipped).
CURVES: list[tuple[str, list[str]]] = [
    ("reward", ["rollout/reward_mean", "val/reward_mean"]),
    ("KL to the reference", ["train/kl", "train/kl_step", "train/kl_epoch"]),
    ("completion length (tokens)", ["rollout/completion_length_mean", "val/completion_length_mean"]),
    ("accuracy", ["val/accuracy", "val/pass@1", "test/accuracy"]),
]


def _with_pass_at_k(log: RunLog, names: list[str]) -> list[str]:
    # pass@k / maj@k keys depend on k: add whichever the run logged to the accuracy panel.
    extra = [key for key in log.keys() if key.startswith(("val/pass@", "val/maj@")) and key not in names]

    def order(key: str) -> tuple[bool, int]:  # pass@1, pass@2, ..., pass@10, then maj@k
        kind, _, k = key.partition("@")
        return kind != "val/pass", int(k) if k.isdigit() else 0

    return names + sorted(extra, key=order)


def plot_run(run: str | Path, out: str | Path | None = None) -> tuple[Path, dict[str, int]]:
    """Render the four panels of ``run`` to ``out``; returns the PNG's path and the points drawn per panel."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    log_file = find_run(run)
    log = load_run(log_file)
    if out is None:
        folder = Path(run) if Path(run).is_dir() else log_file.parent
        out = folder / "curves.png"
    out = Path(out)
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


def main(argv: list[str] | None = None) -> None:
    """Command line: ``plot_run.py RUN [--out PNG]``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="offline W&B run directory or .wandb file, CSVLogger folder or metrics.csv")
    parser.add_argument("--out", help="PNG to write (default: curves.png next to the logs)")
    args = parser.parse_args(argv)
    out, points = plot_run(args.run, args.out)
    print(f"wrote {out} ({', '.join(f'{title}: {n} points' for title, n in points.items())})")


if __name__ == "__main__":
    main()
