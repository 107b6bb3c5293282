"""Held-out accuracy of the quickstart after a fixed budget of rounds, for each recipe in configs/recipes/.

    python tools/bench_recipes.py                     # all recipes, the quickstart's budget
    python tools/bench_recipes.py --rounds 60 --recipes grpo dapo

Each recipe is composed on top of configs/quickstart.yaml (same model, data, seed and learning rate) and trained
for ``--rounds`` rounds; the script prints one Markdown table (accuracy before and after, seconds) for the README.
"""

from __future__ import annotations

import argparse
import time

from grpo_lightning.cli import GRPOCLI

RECIPES = ("grpo", "dapo", "dr_grpo", "gspo", "cispo", "sapo", "gmpo")


def run(recipe: str, rounds: int, extra: list[str]) -> tuple[float, float, float]:
    args = [
        "--config", "configs/quickstart.yaml",
        "--config", f"configs/recipes/{recipe}.yaml",
        "--trainer.max_epochs", str(rounds),
        "--trainer.check_val_every_n_epoch", str(rounds),
        "--trainer.logger", "false",
        "--trainer.callbacks", "[]",
        "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        *extra,
    ]  # fmt: skip
    cli = GRPOCLI(args=args, run=False)
    before = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)[0]["val/accuracy"]
    start = time.perf_counter()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    seconds = time.perf_counter() - start
    after = float(cli.trainer.callback_metrics["val/accuracy"])
    return before, after, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=None, help="rounds per recipe (default: the quickstart's)")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    args, extra = parser.parse_known_args()
    if args.rounds is None:
        import yaml

        args.rounds = yaml.safe_load(open("configs/quickstart.yaml"))["trainer"]["max_epochs"]
    rows = [(recipe, *run(recipe, args.rounds, extra)) for recipe in args.recipes]
    print(f"\n| recipe | held-out accuracy before | after {args.rounds} rounds | fit seconds |")
    print("|---|---|---|---|")
    for recipe, before, after, seconds in rows:
        print(f"| {recipe} | {100 * before:.1f}% | {100 * after:.1f}% | {seconds:.1f} |")


if __name__ == "__main__":
    main()
