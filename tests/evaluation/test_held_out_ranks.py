"""Held-out evaluation on 2 CPU processes (gloo) when the ranks' shares make different numbers of batches.

FSDP2: every held-out batch gathers the sharded policy (an all-gather every rank must join). 5 held-out rows in
batches of 2 are 2 batches on rank 0 and 1 on rank 1: rank 1 must still join rank 0's second gather (a padding
batch), or rank 0 waits there while rank 1 waits in the metrics' sync. DDP, 1 held-out row: rank 1's share is
empty, and it must still log the metrics rank 0 syncs. Padding rows count nothing: the metrics are those of the
real rows.

One ``torchrun --nproc_per_node=2`` launch of this file (``worker``) validates both, with a process-group timeout
short enough that a hang fails the test in a minute rather than after the strategies' default 30 minutes.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from helpers import run_on_two_processes
from lightning import Callback, Trainer
from lightning.pytorch.strategies import DDPStrategy

from grpo_lightning import EvalConfig, GRPOModule, RolloutDataModule, SamplingConfig
from grpo_lightning.cli import TRAINER_DEFAULTS
from grpo_lightning.models.tiny import TinyModelConfig
from grpo_lightning.strategies import FSDP2Strategy

TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=64)
PG_TIMEOUT = timedelta(seconds=30)  # a collective one rank never joins fails the worker after this
RUNS = {"fsdp": (5, 2), "ddp": (1, 1)}  # val_limit, val_batch_size


class Batches(Callback):
    """What each held-out batch of this rank held: its rows' greedy lengths."""

    def __init__(self) -> None:
        self.lengths: list[list[float]] = []

    def on_validation_batch_end(self, trainer: Trainer, module: Any, outputs: Any, batch: Any, *args: Any) -> None:
        self.lengths.append(batch["length"].tolist())


def worker(out: Path) -> None:
    rank = int(os.environ["RANK"])
    results = {}
    strategies = {"fsdp": lambda: FSDP2Strategy(timeout=PG_TIMEOUT), "ddp": lambda: DDPStrategy(timeout=PG_TIMEOUT)}
    for name, (limit, batch_size) in RUNS.items():
        module = GRPOModule(tiny_model=TINY)
        data = RolloutDataModule(
            sampling=SamplingConfig(group_size=2, max_new_tokens=4),
            eval=EvalConfig(num_samples=2, limit=limit, batch_size=batch_size),
            task_kwargs={"test_size": 50},
        )
        batches = Batches()
        trainer = Trainer(
            **TRAINER_DEFAULTS,
            accelerator="cpu",
            devices=2,
            strategy=strategies[name](),
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[batches],
            default_root_dir=out / name,
        )
        metrics = trainer.validate(module, datamodule=data, verbose=False)[0]
        results[name] = {"metrics": metrics, "lengths": batches.lengths}
    (out / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("held-out-ranks")
    run_on_two_processes(__file__, out, outputs=["rank0.json", "rank1.json"], timeout_s=240)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("name", list(RUNS))
def test_uneven_shares_finish_and_count_the_real_rows_once(ranks: list[dict[str, Any]], name: str) -> None:
    first, second = (rank[name] for rank in ranks)
    assert len(first["lengths"]) == len(second["lengths"])  # the same number of batches (of gathers)
    rows = [n for rank in (first, second) for batch in rank["lengths"] for n in batch]
    assert len(rows) == RUNS[name][0]  # the padding batch's row is not among them
    assert first["metrics"] == second["metrics"]  # synced
    assert first["metrics"]["val/completion_length_mean"] == pytest.approx(sum(rows) / len(rows))
    assert {"val/pass@2", "val/maj@2", "val/sample_reward_mean"} <= set(first["metrics"])


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    worker(Path(sys.argv[1]))
