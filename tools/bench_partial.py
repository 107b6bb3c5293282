"""Partial rollouts, measured: trajectories per second of ``data.schedule.partial_rollouts`` against the fixed lag 1.

    python tools/bench_partial.py                      # 2 runs of each row, rotated, in this process
    python tools/bench_partial.py --runs 3 --rounds 2 10 --max-new-tokens 128
    python tools/bench_partial.py --quick              # a few rounds of each: does it run (no figures to quote)
    python tools/bench_partial.py --workload tool      # multi-turn: a tool that waits on I/O (issue 53, point 5)
    python tools/bench_partial.py --device cuda        # on a GPU (tools/gpu_check.sh, part "partial")

The workload has long-tailed completion lengths: a tiny random Llama whose EOS row of the output layer is the mean
direction of its hidden states (scaled by ``--eos-weight``), so that most completions end after a few tokens and
some run to ``max_new_tokens`` (the bench prints the lengths' median, 90th percentile and share at the limit).
At a fixed lag every round waits for its longest completion; with partial rollouts (the same staleness bound,
``max_staleness``, and ``tokens_per_push`` = ⌈max_new_tokens / 4⌉) the background process decodes each sequence at
most ``tokens_per_push`` tokens per push and a round takes the groups that have ended.

``--workload tool``: the calculator demo's model (``grpo_lightning/assets/tiny-calc``: it calls the tool in a good
share of its samples) against ``ToolEnvironment``, its calculator behind a service call: each call waits
``--tool-wait-ms`` (100–300 ms by default: a search's or a sandbox's latency, about a turn's decoding or longer, so
that the waits are most of a round at lag 1; ``calculator`` below: a function of the call's argument, so both rows
wait alike) before it answers. Trajectory lengths have the demo's tail (0 to 2 tool calls, answers of different
lengths, the odd turn run to its limit). At a fixed lag a round waits for its tool calls turn after turn (each
wave of calls as long as its slowest); with partial rollouts each call runs in the background of the segments and
its observation joins a push later, so the waits overlap the push, the update and the decoding. The calls run at
once (``max_concurrency``, ``--tool-concurrency``) in both rows; by default as many as the partial row's pool holds
trajectories (``prompts × group_size × ⌈max_new_tokens / tokens_per_push⌉``: fewer would queue its calls), and
``max_staleness`` the bound a trajectory's pushes and turns need (``Environment.pushes_spanned``). Per run the bench
prints the seconds a round spends in the environment beside its generation (``environment_s``, ``generate_s``: at
lag 1, the share of the waits) and, for ``partial``, what the segments waited for the background steps
(``environment_wait_s``) and how many they launched (``environment_steps``).

Rows (each run is a whole ``fit`` in this process, the rows rotated so that the machine's drift hits both alike):

- ``lag1``: ``rollout_lag: 1``;
- ``partial``: ``rollout_lag: 1``, ``partial_rollouts: true``.

Per run, over the measured rounds (after the warm-up rounds): trajectories per second (completions trained on per
second of wall time, from the end of the last warm-up round to the end of the last round), the mean completion
length, and for ``partial`` the mean staleness, the sequences that spanned a push and the groups dropped as stale.
The last line is the ratio of the rows' medians. The machine (CPU model, torch's CPU capability, threads, torch
version) is printed first: figures are comparable only on one idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import torch

ROWS = ("lag1", "partial")
TINY_CALC = Path(__file__).resolve().parents[1] / "grpo_lightning" / "assets" / "tiny-calc"


WAIT_VARIABLE = "BENCH_PARTIAL_TOOL_WAIT_MS"  # how the background process learns ``--tool-wait-ms``


def calculator(argument: str) -> str:
    """The calculator behind a service call: waits between ``--tool-wait-ms``'s bounds (a function of ``argument``:
    every run waits alike), then answers as the built-in ``calculator`` does. Named ``calculator``: the tool the demo's
    model calls."""
    from grpo_lightning.integrations.environments.tools import resolve_tool

    low, high = (float(ms) / 1000 for ms in os.environ.get(WAIT_VARIABLE, "100,300").split(","))
    time.sleep(low + (high - low) * (zlib.crc32(argument.encode()) % 1000) / 1000)
    return resolve_tool("calculator")(argument)


def machine() -> str:
    """The CPU model, torch's CPU capability, the threads and torch's version."""
    model = platform.processor() or "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
        model = names[0] if names else model
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{model}; torch CPU capability {capability}; {torch.get_num_threads()} threads; torch {torch.__version__}"


def build_model(folder: Path, eos_weight: float, max_new_tokens: int) -> Path:
    """The long-tail model: a tiny random Llama whose EOS row of the output layer is ``eos_weight`` × the mean
    direction of its last hidden states over a generation, so that the EOS logit is that projection: high in most
    contexts (short completions), low in some (a tail up to ``max_new_tokens``). Saved with its tokenizer."""
    from grpo_lightning.engines.lean import sample_completions
    from grpo_lightning.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_llama

    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    config = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
    config.max_position_embeddings = max(256, 2 * max_new_tokens)
    model = build_tiny_llama(config, tokenizer).eval()
    prompts = tokenizer([f"What is {j} + {3 * j}? Answer:" for j in range(32)], return_tensors="pt", padding=True)
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        out = sample_completions(
            model, prompts["input_ids"], prompts["attention_mask"], group_size=1, max_new_tokens=64,
            eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, generator=torch.Generator().manual_seed(1),
        )  # fmt: skip
        ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
        mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()].mean(0)
        model.lm_head.weight[eos] = eos_weight * hidden / hidden.norm()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def prompts_file(folder: Path) -> Path:
    """The training prompts: 512 sums in the form the model's EOS row was set on (``build_model``)."""
    path = folder / "prompts.jsonl"
    rows = [{"prompt": f"What is {i} + {3 * i}? Answer:", "answer": str(4 * i)} for i in range(512)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run(row: str, model: Path, args: argparse.Namespace) -> dict[str, float]:
    """One fit of ``row``; its trajectories per second over the measured rounds and its round metrics' means."""
    import lightning as L

    from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
    from grpo_lightning.cli import TRAINER_DEFAULTS
    from grpo_lightning.config import EvalConfig, ScheduleConfig, UpdateConfig
    from grpo_lightning.rewards import RewardSpec

    warmup, measured = args.rounds
    ends: list[float] = []
    rounds: list[dict[str, float]] = []

    class Clock(L.Callback):
        def on_train_epoch_end(self, trainer: L.Trainer, module: Any) -> None:
            ends.append(time.perf_counter())
            rollout = trainer.datamodule.last_rollout
            rounds.append({**rollout.metrics, "length": rollout.completion_mask.sum(1).float().mean().item()})

    schedule = ScheduleConfig(
        rollout_lag=1, partial_rollouts=row == "partial", max_staleness=args.max_staleness, rollout_threads=1
    )
    L.seed_everything(0)
    module = GRPOModule(model_name_or_path=str(model), objective=ObjectiveConfig(beta=0.0), lr=1e-4)
    data = RolloutDataModule(
        rewards=[RewardSpec("exact_answer")],
        sampling=SamplingConfig(group_size=args.group_size, max_new_tokens=args.max_new_tokens),
        schedule=schedule,
        prompts_per_round=args.prompts,
        update=UpdateConfig(),
        eval=EvalConfig(limit=0),
        val_split=None,
        **workload_data(model, args),
    )
    trainer = L.Trainer(
        **TRAINER_DEFAULTS,
        max_epochs=warmup + measured,
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[Clock()],
    )
    trainer.fit(module, datamodule=data)
    trajectories = measured * args.prompts * args.group_size
    kept = rounds[warmup:]

    def mean(name: str) -> float:
        return statistics.fmean(r.get(name, 0.0) for r in kept)

    return {
        "trajectories_per_s": trajectories / (ends[-1] - ends[warmup - 1]),
        "length": mean("length"),
        "staleness": mean("rollout/staleness_mean") if row == "partial" else 1.0,
        "interrupted": mean("rollout/interrupted_sequences"),
        "stale_groups": mean("rollout/stale_groups"),
        "waited_segments": mean("rollout/segments_waited"),
        "generate_s": mean("time/generate"),
        "environment_s": mean("time/environment"),
        "environment_wait_s": mean("time/environment_wait"),
        "environment_steps": mean("rollout/environment_steps"),
        "wait_s": mean("time/wait"),
    }


def workload_data(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The data of ``--workload``: the long-tail model's sums, or the calculator demo's products with its tool
    behind a network call (``calculator``)."""
    if args.workload == "single":
        return {"dataset": str(model / "prompts.jsonl")}

    environment = tool_environment(args.tool_concurrency)
    return {
        "dataset": "multiplication",
        "task_kwargs": {"train_size": 2000, "test_size": 8},
        "environment": environment,
    }


def tool_environment(concurrency: int) -> Any:
    """``--workload tool``'s environment: the demo's calculator (``calculator``), ``concurrency`` calls at once."""
    from grpo_lightning.integrations.environments import ToolEnvironment

    return ToolEnvironment(
        tools=["bench_partial:calculator"], format="tag", max_turns=3, max_turn_tokens=40, max_observation_tokens=32,
        max_concurrency=concurrency,
    )  # fmt: skip


def tool_defaults(args: argparse.Namespace) -> None:
    """``--workload tool``'s unset settings: the demo's ``max_new_tokens``, the calls of the partial row's pool at
    once, the staleness its trajectories' pushes and turns need."""
    from grpo_lightning.config import ScheduleConfig

    args.max_new_tokens = 96 if not args.quick else 64  # the demo's: turns and observations together
    budget = ScheduleConfig().segment_tokens(args.max_new_tokens)
    pushes = -(-args.max_new_tokens // budget)
    if args.tool_concurrency is None:
        args.tool_concurrency = args.prompts * args.group_size * pushes
    if args.max_staleness is None:
        args.max_staleness = tool_environment(1).pushes_spanned(args.max_new_tokens, budget)
    os.environ[WAIT_VARIABLE] = ",".join(str(ms) for ms in args.tool_wait_ms)


def lengths(model: Path, args: argparse.Namespace) -> str:
    """The workload's completion lengths (one draw of 32 prompts × G from the model as built)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_lightning.engines.lean import sample_completions

    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model).eval()
    prompts = tokenizer([f"What is {i} + {3 * i}? Answer:" for i in range(64, 96)], return_tensors="pt", padding=True)
    out = sample_completions(
        policy, prompts["input_ids"], prompts["attention_mask"], group_size=args.group_size,
        max_new_tokens=args.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    n = out.completion_mask.sum(1).float()
    at_limit = (n >= args.max_new_tokens).float().mean().item()
    return f"lengths: median {n.median():.0f}, p90 {n.quantile(0.9):.0f}, {at_limit:.1%} at max_new_tokens"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--rounds", nargs=2, type=int, default=(2, 8), metavar=("WARMUP", "MEASURED"))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per round")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument(
        "--max-staleness", type=int, default=None, help="η of both rows (4; --workload tool: what its turns need)"
    )
    parser.add_argument("--eos-weight", type=float, default=0.5, help="the EOS row's scale: lower, longer")
    parser.add_argument("--quick", action="store_true", help="1 run of 1 + 2 rounds each, 32 new tokens")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: the trainer and its background process on a GPU"
    )
    parser.add_argument(
        "--workload", choices=("single", "tool"), default="single",
        help="single: the long-tail model's single-turn sums; tool: the calculator demo, its tool waiting on I/O",
    )  # fmt: skip
    parser.add_argument(
        "--tool-concurrency", type=int, default=None,
        help="--workload tool: tool calls run at once (default: the partial row's pool's trajectories)",
    )  # fmt: skip
    parser.add_argument(
        "--tool-wait-ms", nargs=2, type=float, default=(100.0, 300.0), metavar=("LOW", "HIGH"),
        help="--workload tool: each tool call waits between these, a function of its argument",
    )  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.runs, args.rounds, args.max_new_tokens, args.prompts = 1, (1, 2), 32, 4
    if args.workload == "tool":
        tool_defaults(args)
    elif args.max_staleness is None:
        args.max_staleness = 4
    torch.set_num_threads(max(2, torch.get_num_threads()))
    print(machine())
    if args.device == "cuda":
        print(f"GPU: {torch.cuda.get_device_name()}")
    with tempfile.TemporaryDirectory() as folder:
        if args.workload == "tool":
            model = TINY_CALC
            low, high = args.tool_wait_ms
            print(
                f"workload: the calculator demo's model and products, each tool call waiting {low:g}-{high:g} ms; "
                f"{args.tool_concurrency} calls at once; max_staleness {args.max_staleness}"
            )
        else:
            model = build_model(Path(folder), args.eos_weight, args.max_new_tokens)
            prompts_file(model)
            print(lengths(model, args))
        results: dict[str, list[dict[str, float]]] = {row: [] for row in ROWS}
        for i in range(args.runs):
            for row in ROWS if i % 2 == 0 else ROWS[::-1]:  # rotated: the machine's drift hits both rows alike
                result = run(row, model, args)
                results[row].append(result)
                print(row, " ".join(f"{k}={v:.3g}" for k, v in result.items()), flush=True)
    medians = {row: statistics.median(r["trajectories_per_s"] for r in results[row]) for row in ROWS}
    if args.workload == "tool":  # the waits' share of a round's generation at lag 1: what partial rollouts hide
        share = statistics.median(r["environment_s"] / r["generate_s"] for r in results["lag1"])
        print(f"lag1: environment steps {share:.0%} of generation")
    print(f"partial / lag1 trajectories per second: {medians['partial'] / medians['lag1']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
