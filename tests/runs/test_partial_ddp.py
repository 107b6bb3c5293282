"""Partial rollouts under data parallelism (DDP on 2 CPU processes, gloo): each rank has its own background process,
pool and queue, draws its own slot of each window of the prompt stream, and logs the same metric names.

One ``torchrun --nproc_per_node=2`` launch of this file (``worker``) runs 4 rounds uninterrupted, then 2 rounds and 2
more from the checkpoint (sequences in flight across it on both ranks), and writes what each rank saw.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import run_on_two_processes
from lightning import Callback, Trainer
from lightning.pytorch.strategies import DDPStrategy

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.callbacks.checkpointing import RoundCheckpoint
from grpo_lightning.cli import TRAINER_DEFAULTS
from grpo_lightning.config import ScheduleConfig
from grpo_lightning.models.tiny import TinyModelConfig
from grpo_lightning.rewards import RewardSpec

pytestmark = pytest.mark.slow  # 2 processes, each with a background process: the slow tier

TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=64)
WORLD, ROUNDS = 2, 4


class Rounds(Callback):
    """Each round's partial-rollout metrics and prompts, on this rank."""

    def __init__(self) -> None:
        self.rounds: list[dict[str, Any]] = []

    def on_train_epoch_end(self, trainer: Trainer, module: GRPOModule) -> None:
        rollout = trainer.datamodule.last_rollout
        metrics = {k: v for k, v in rollout.metrics.items() if k.startswith("rollout/") and "time" not in k}
        self.rounds.append({"metrics": metrics, "prompts": list(rollout.prompts), "completions": rollout.completions})


def fit(out: Path, epochs: int, ckpt_path: str | None = None) -> tuple[GRPOModule, Rounds]:
    torch.manual_seed(0)
    module = GRPOModule(tiny_model=TINY, objective=ObjectiveConfig(beta=0.0), lr=1e-3)
    data = RolloutDataModule(
        rewards=[RewardSpec("exact_answer")],
        sampling=SamplingConfig(group_size=2, max_new_tokens=6),
        schedule=ScheduleConfig(rollout_lag=1, partial_rollouts=True, tokens_per_push=2, rollout_threads=1),
        prompts_per_round=2,
        val_split=None,
        task_kwargs={"test_size": 50},
    )
    rounds = Rounds()
    trainer = Trainer(
        **TRAINER_DEFAULTS,
        accelerator="cpu",
        devices=WORLD,
        strategy=DDPStrategy(timeout=timedelta(minutes=2)),
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[rounds, RoundCheckpoint(dirpath=str(out))],
        default_root_dir=out,
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module, rounds


def worker(out: Path) -> None:
    rank = int(os.environ["RANK"])
    reference, whole = fit(out / "reference", ROUNDS)
    _, first = fit(out / "run", 2)
    resumed, second = fit(out / "run", ROUNDS, ckpt_path="last")
    weights = [reference.state_dict(), resumed.state_dict()]
    torch.save(weights, out / f"weights{rank}.pt")
    result = {"whole": whole.rounds, "resumed": first.rounds + second.rounds}
    (out / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], list[list[dict]]]:
    out = tmp_path_factory.mktemp("partial-ddp")
    outputs = [f"rank{r}.json" for r in range(WORLD)] + [f"weights{r}.pt" for r in range(WORLD)]
    run_on_two_processes(__file__, out, outputs=outputs, timeout_s=600)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    weights = [torch.load(out / f"weights{r}.pt", weights_only=True) for r in range(WORLD)]
    return results, weights


def test_each_rank_trains_on_its_own_prompts_with_sequences_spanning_pushes(ranks) -> None:
    results, _ = ranks
    for r in range(ROUNDS):
        rounds = [result["whole"][r] for result in results]
        assert list(rounds[0]["metrics"]) == list(rounds[1]["metrics"])  # the same names on every rank
        assert not set(rounds[0]["prompts"]) & set(rounds[1]["prompts"])  # each rank its own slot of the stream
    assert any(round_["metrics"]["rollout/interrupted_sequences"] for result in results for round_ in result["whole"])


def test_ranks_agree_and_two_rounds_then_two_more_equal_four(ranks) -> None:
    results, weights = ranks
    for rank in range(WORLD):
        assert results[rank]["resumed"] == results[rank]["whole"]
        reference, resumed = weights[rank]
        assert all(torch.equal(resumed[k], v) for k, v in reference.items())
    assert all(torch.equal(weights[0][0][k], v) for k, v in weights[1][0].items())  # DDP: the ranks' weights agree


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    worker(Path(sys.argv[1]))
