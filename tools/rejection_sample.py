"""Rejection sampling: k completions per prompt from a policy, scored by the configured reward functions; the best
one (or every one at or above a threshold, deduplicated) becomes a row of an SFT dataset.

    python tools/rejection_sample.py --config configs/pipeline/2_reasoning_rl.yaml \\
        --ckpt_path runs/pipeline/2_reasoning_rl/checkpoints/last.ckpt --out runs/pipeline/3_rejection/data.jsonl \\
        --k 8 --threshold 1.0 --num_prompts 2000

``--config`` is a GRPO config (``python -m grpo_lightning``'s): its ``model`` section gives the policy, its
``data`` section the prompts (``train`` split by default), the engine, the sampling settings and the rewards.
Further ``--model.*``/``--data.*`` arguments override it as on the GRPO command line. ``--ckpt_path`` loads the
policy's weights from a Lightning checkpoint of that config (without it, the config's starting model samples).
Generation and scoring are a rollout's own (``rollout.sampling.sample_and_score``).

The output is a ``.jsonl`` of ``prompt``, ``response``, ``reward`` and the prompt's other columns, which
``grpo_lightning.integrations.sft.SFTDataModule`` reads as it is. A second file (``--report``, default
``<out>.acceptance.jsonl``) gives each prompt's acceptance rate: the share of its k samples whose reward reached the
threshold.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Literal

import torch

from grpo_lightning.cli import GRPOCLI
from grpo_lightning.engines import SamplingParams, build_engine
from grpo_lightning.module import GRPOModule
from grpo_lightning.rollout.prompts import load_prompts, rename_prompt_column
from grpo_lightning.rollout.sample_and_score import sample_and_score


def select_completions(
    completions: list[str],
    rewards: list[float],
    group_size: int,
    *,
    mode: Literal["best", "threshold"] = "best",
    threshold: float | None = None,
    rejected: list[bool] | None = None,
) -> list[list[int]]:
    """Per prompt, the positions (within its group of ``group_size`` adjacent completions) to keep.

    ``best``: the highest-reward completion (the first of equal ones), if it reaches ``threshold`` (any reward
    when ``threshold`` is None). ``threshold``: every completion whose reward reaches ``threshold``, in sampling
    order, keeping only the first of identical texts (compared without surrounding whitespace).
    ``rejected[i]`` excludes completion ``i`` in either mode (e.g. truncated ones).
    """
    if len(completions) != len(rewards) or len(rewards) % group_size:
        raise ValueError(f"{len(completions)} completions, {len(rewards)} rewards, groups of {group_size}")
    if mode == "threshold" and threshold is None:
        raise ValueError("mode='threshold' needs a threshold")
    if mode not in ("best", "threshold"):
        raise ValueError(f"mode must be 'best' or 'threshold' (got {mode!r})")
    kept = []
    for start in range(0, len(rewards), group_size):
        candidates = [
            i
            for i in range(group_size)
            if not (rejected and rejected[start + i]) and (threshold is None or rewards[start + i] >= threshold)
        ]
        if mode == "best":
            # max() returns the first of equal maxima: the earliest sample wins a tie.
            kept.append([max(candidates, key=lambda i: rewards[start + i])] if candidates else [])
            continue
        seen, chosen = set(), []
        for i in candidates:
            text = completions[start + i].strip()
            if text not in seen:
                seen.add(text)
                chosen.append(i)
        kept.append(chosen)
    return kept


def acceptance_rates(
    rewards: list[float], group_size: int, threshold: float | None, rejected: list[bool] | None = None
) -> list[float]:
    """Per prompt: the share of its samples that reach ``threshold`` (and are not ``rejected``)."""
    rates = []
    for start in range(0, len(rewards), group_size):
        passed = sum(
            1
            for i in range(start, start + group_size)
            if not (rejected and rejected[i]) and (threshold is None or rewards[i] >= threshold)
        )
        rates.append(passed / group_size)
    return rates


def build_module(config: list[str], overrides: list[str]) -> tuple[GRPOModule, Any]:
    """The config's ``GRPOModule`` and ``RolloutDataModule``, as ``python -m grpo_lightning`` builds them."""
    args = [arg for path in config for arg in ("--config", path)]
    # The Trainer is built by the CLI but never run: no logger, no callbacks (no files, no W&B run).
    args += [*overrides, "--trainer.logger=false", "--trainer.callbacks=[]", "--trainer.enable_checkpointing=false"]
    argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when given args while sys.argv has others too
    try:
        cli = GRPOCLI(args=args, run=False)
    finally:
        sys.argv = argv
    return cli.model, cli.datamodule


def load_policy_weights(module: GRPOModule, ckpt_path: str) -> None:
    """Load the policy's weights from a Lightning checkpoint (trusted: unpickled in full, as ``fit`` does)."""
    checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    prefix = "policy."
    state = {k[len(prefix) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    if not state:
        raise SystemExit(f"error: {ckpt_path} holds no policy weights (no 'policy.*' keys)")
    module.policy.load_state_dict(state)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Command line; returns the summary it prints."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", required=True, help="GRPO config (repeatable, composes)")
    parser.add_argument("--ckpt_path", help="Lightning checkpoint whose policy samples (default: the config's model)")
    parser.add_argument("--out", required=True, help="output .jsonl (prompt, response, reward, other columns)")
    parser.add_argument("--report", help="per-prompt acceptance .jsonl (default: <out>.acceptance.jsonl)")
    parser.add_argument("--k", type=int, default=8, help="completions sampled per prompt")
    parser.add_argument("--mode", choices=("best", "threshold"), default="best")
    parser.add_argument("--threshold", type=float, help="minimum total reward to keep a completion")
    parser.add_argument("--temperature", type=float, help="sampling temperature (default: the config's)")
    parser.add_argument("--split", help="split of data.dataset to sample prompts from (default: data.train_split)")
    parser.add_argument("--num_prompts", type=int, help="a random subset of this many prompts (default: all)")
    parser.add_argument("--prompts_per_batch", type=int, default=128, help="prompts generated at once")
    parser.add_argument("--keep_truncated", action="store_true", help="also keep completions cut by max_new_tokens")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt subset and of sampling")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args, overrides = parser.parse_known_args(argv)
    if args.mode == "threshold" and args.threshold is None:
        parser.error("--mode threshold needs --threshold")

    start = time.perf_counter()
    # Only the policy samples: no reference model is built.
    module, data = build_module(args.config, [*overrides, "--model.objective.beta=0.0"])
    module.configure_model()
    if args.ckpt_path:
        load_policy_weights(module, args.ckpt_path)
    module.to(args.device).eval()
    changes = {"group_size": args.k} | ({"temperature": args.temperature} if args.temperature is not None else {})
    params = SamplingParams.from_config(data.sampling, **changes)
    engine = build_engine(data.engine)
    engine.setup(module.policy, module.tokenizer, module.modality)
    # the config's chat settings: template, system prompt, kwargs
    encoder = data.encoder(module.tokenizer, module.modality)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)

    if args.split:
        rows = load_prompts(data.source, args.split, subset=data.subset, task_kwargs=data.task_kwargs)
    else:  # the training rows: without those data.val_fraction holds out
        rows = data.sources.training_rows()
    rows = rename_prompt_column(rows, data.prompt_column, f"data.dataset ({data.source})")
    order = list(range(len(rows)))
    if args.num_prompts is not None and args.num_prompts < len(rows):
        order = sorted(random.Random(args.seed).sample(order, args.num_prompts))
    rows = rows.select(order)

    out, report = Path(args.out), Path(args.report or f"{Path(args.out).with_suffix('')}.acceptance.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    report.parent.mkdir(parents=True, exist_ok=True)
    k, kept_rows, with_row, rates, timings = args.k, 0, 0, [], {"generate": 0.0, "score": 0.0}
    with out.open("w") as out_file, report.open("w") as report_file:
        for first in range(0, len(rows), args.prompts_per_batch):
            batch = rows[first : first + args.prompts_per_batch]
            with torch.no_grad():
                rollout = sample_and_score(
                    batch,
                    engine=engine,
                    encoder=encoder,
                    scorer=data.scorer,
                    params=params,
                    generator=generator,
                    device=args.device,
                    timings=timings,
                    environment=data.environment,  # multi-turn: trajectories against data.environment
                )
            rewards = rollout.rewards.tolist()
            # Multi-turn: the response is the whole transcript (the SFT that reads it trains on its observations
            # too: SFTModule has no environment mask yet).
            responses = rollout.transcripts or rollout.completions
            rejected = None if args.keep_truncated else rollout.truncated.tolist()
            kept = select_completions(
                rollout.completions, rewards, k, mode=args.mode, threshold=args.threshold, rejected=rejected
            )
            batch_rates = acceptance_rates(rewards, k, args.threshold, rejected)
            for p, prompt in enumerate(batch["prompt"]):
                others = {name: values[p] for name, values in batch.items() if name != "prompt"}
                for i in kept[p]:
                    row = {"prompt": prompt, "response": responses[p * k + i], "reward": rewards[p * k + i]}
                    out_file.write(json.dumps({**row, **others}) + "\n")
                group = rewards[p * k : (p + 1) * k]
                entry = {"prompt": prompt, "acceptance_rate": batch_rates[p], "kept": len(kept[p])}
                report_file.write(json.dumps({**entry, "best_reward": max(group)}) + "\n")
            kept_rows += sum(len(positions) for positions in kept)
            with_row += sum(1 for positions in kept if positions)
            rates += batch_rates

    histogram = Counter(round(rate * k) for rate in rates)
    summary = {
        "prompts": float(len(rates)),
        "samples": float(len(rates) * k),
        "rows_written": float(kept_rows),
        "mean_acceptance_rate": sum(rates) / max(1, len(rates)),
        "prompts_with_a_row": with_row / max(1, len(rates)),
        "seconds": time.perf_counter() - start,
    }
    print(f"rejection sampling: {len(rates)} prompts × k={k}, {kept_rows} rows written to {out}")
    print(f"  mean acceptance rate {summary['mean_acceptance_rate']:.3f}; per-prompt acceptance rates in {report}")
    print("  accepted/k: " + ", ".join(f"{n}/{k}: {histogram[n]} prompts" for n in range(k + 1) if histogram[n]))
    print(f"  {summary['seconds']:.0f} s (generate {timings['generate']:.0f} s, score {timings['score']:.0f} s)")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
