"""Rollout metrics under DDP on 2 CPU processes (gloo) when the ranks' rounds differ in what they saw.

Only rank 0's trajectories call a "tool" (``FlaggedEnvironment`` reports ``tool_calls`` and a reward part ``bonus``
for flagged prompts, and only rank 0 draws flagged ones), and the reward ``metrics_flagged_length`` applies to
flagged prompts only (None elsewhere: ``reward/metrics_flagged_length`` is NaN on rank 1). Every rank must still
log the same keys in the same order, with the values of the whole round, and neither hang nor fail.

One ``torchrun --nproc_per_node=2`` launch of this file (``worker``) runs 2 rounds and writes what each rank saw
and logged to a folder; the test checks the two ranks against each other.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from helpers import run_on_two_processes
from lightning import Callback, Trainer
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import DDPStrategy

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.cli import TRAINER_DEFAULTS
from grpo_lightning.integrations.environments import Environment, Step
from grpo_lightning.models.tiny import TinyModelConfig
from grpo_lightning.rewards import RewardSpec, register

ROOT = Path(__file__).resolve().parents[2]
TINY = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=64)
WORLD, GROUP, PROMPTS, ROUNDS = 2, 2, 2, 2  # PROMPTS per rank and round
BONUS = 0.5
# A collective that one rank never joins fails the worker after this (gloo's "Timed out"), instead of hanging it.
PG_TIMEOUT = timedelta(seconds=60)
LOGGED = ("rollout/", "reward/", "time/")


@register("metrics_flagged_length")
def flagged_length(prompts: list[str], completions: list[str], flagged: Any = None, **_: Any) -> list[float | None]:
    """The completion's length for flagged prompts; not applicable (None) to the others."""
    flags = flagged or [False] * len(completions)
    return [float(len(c)) if f else None for c, f in zip(completions, flags)]


class FlaggedEnvironment(Environment):
    """A flagged prompt's trajectory makes one "tool call" in its first turn (the reward part ``bonus``, an
    observation, then a second turn); any other ends after one turn. Turns end at a digit or a lowercase letter,
    which the random model draws often, so that the flagged trajectories really have two turns."""

    @property
    def stop_texts(self) -> tuple[str, ...]:
        return tuple("0123456789abcdefghijklmnopqrstuvwxyz")

    def reset(self, row: dict[str, Any]) -> None:
        self.flagged, self.calls = bool(row.get("flagged")), 0
        return None

    def step(self, turn: str) -> Step:
        if self.flagged and not self.calls:
            self.calls += 1
            return Step(observation="<r>1</r>", rewards={"bonus": BONUS}, metrics={"tool_calls": 1.0})
        return Step(done=True)


class RankZeroFlags(RolloutDataModule):
    """Flags the first prompt of rank 0's draws; no prompt of any other rank."""

    def next_prompts(self) -> dict[str, list[Any]]:
        rows = super().next_prompts()
        rows["flagged"] = [self.trainer.global_rank == 0 and i == 0 for i in range(len(rows["prompt"]))]
        return rows


class MemoryLogger(Logger):
    """Every ``log_metrics`` call, as logged (Lightning calls loggers on every rank; this one records on all)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append({k: float(v) for k, v in metrics.items() if k.startswith(LOGGED)})

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class RoundRecord(Callback):
    """Each round's own (this rank's) metrics and column names, and the keys callbacks can monitor at the end."""

    def __init__(self) -> None:
        self.rounds: list[dict[str, Any]] = []
        self.monitorable: list[str] = []

    def on_train_epoch_end(self, trainer: Trainer, module: GRPOModule) -> None:
        rollout = trainer.datamodule.last_rollout
        self.rounds.append(
            {
                "local": rollout.metrics,
                "turn_stats": {k: list(v) for k, v in rollout.turn_stats.items()},
                "reward_columns": list(rollout.reward_columns),
            }
        )

    def on_train_end(self, trainer: Trainer, module: GRPOModule) -> None:
        self.monitorable = [k for k in trainer.callback_metrics if k.startswith(LOGGED)]


def worker(out: Path) -> None:
    rank = int(os.environ["RANK"])
    module = GRPOModule(tiny_model=TINY, objective=ObjectiveConfig(beta=0.0), lr=1e-3)
    data = RankZeroFlags(
        rewards=[RewardSpec("metrics_flagged_length")],
        environment=FlaggedEnvironment(max_turns=2, max_turn_tokens=6),
        sampling=SamplingConfig(group_size=GROUP, max_new_tokens=24),
        prompts_per_round=PROMPTS,
        val_split=None,
        task_kwargs={"test_size": 50},
    )
    logger, record = MemoryLogger(), RoundRecord()
    trainer = Trainer(
        **TRAINER_DEFAULTS,
        accelerator="cpu",
        devices=WORLD,
        strategy=DDPStrategy(timeout=PG_TIMEOUT),
        max_epochs=ROUNDS,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
        default_root_dir=out / "run",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=data)
    result = {
        "logged": [call for call in logger.calls if any(k.startswith(("rollout/", "reward/")) for k in call)],
        "rounds": record.rounds,
        "monitorable": record.monitorable,
        "sync_warnings": [str(w.message) for w in caught if "sync_dist" in str(w.message)],
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Launch the worker on 2 processes; what each rank recorded."""
    out = tmp_path_factory.mktemp("metrics-ddp")
    run_on_two_processes(__file__, out, outputs=[f"rank{r}.json" for r in range(WORLD)], timeout_s=300)
    files = [out / f"rank{r}.json" for r in range(WORLD)]
    return [json.loads(f.read_text()) for f in files]


def test_every_rank_logs_the_same_keys_in_the_same_order(ranks: list[dict[str, Any]]) -> None:
    first, second = ranks
    assert len(first["logged"]) == len(second["logged"]) == ROUNDS
    for logged_0, logged_1 in zip(first["logged"], second["logged"]):
        assert list(logged_0) == list(logged_1)
        assert "rollout/tool_calls_mean" in logged_0 and "reward/env_bonus" in logged_0
        assert "reward/metrics_flagged_length" in logged_0
        # Reduced once, identically: the same values on both ranks (only rank 0's reach a real logger).
        assert logged_0 == logged_1
    assert first["monitorable"] == second["monitorable"] and "rollout/tool_calls_mean" in first["monitorable"]
    assert first["sync_warnings"] == [] and second["sync_warnings"] == []


def test_the_logged_values_are_those_of_both_ranks(ranks: list[dict[str, Any]]) -> None:
    for r in range(ROUNDS):
        logged = ranks[0]["logged"][r]
        local = [rank["rounds"][r]["local"] for rank in ranks]
        # Rank 1 made no tool call and earned no bonus: its trajectories count as 0, not as absent.
        assert ranks[1]["rounds"][r]["turn_stats"]["tool_calls"] == [0.0] * PROMPTS * GROUP
        assert ranks[0]["rounds"][r]["reward_columns"] == ranks[1]["rounds"][r]["reward_columns"]
        assert "env_bonus" in ranks[1]["rounds"][r]["reward_columns"]
        # Multi-turn on rank 0 only: a flagged trajectory answered by an observation went on to a second turn.
        turns = [rank["rounds"][r]["turn_stats"] for rank in ranks]
        assert max(turns[0]["turns"]) == 2 and max(turns[0]["env_tokens"]) > 0
        assert max(turns[1]["turns"]) == 1 and max(turns[1]["env_tokens"]) == 0
        # Rank 0: the first of its 2 prompts is flagged, so 2 of its 4 trajectories; none of rank 1's.
        assert local[0]["rollout/tool_calls_mean"] == 0.5 and local[1]["rollout/tool_calls_mean"] == 0.0
        assert logged["rollout/tool_calls_mean"] == pytest.approx(2 / (WORLD * PROMPTS * GROUP))
        # A reward part is a reward column: None where a trajectory earned none (NaN on rank 1, left out).
        assert logged["reward/env_bonus"] == pytest.approx(BONUS)
        # NaN on rank 1 (no applicable value): the mean of the ranks that have one.
        assert local[1]["reward/metrics_flagged_length"] != local[1]["reward/metrics_flagged_length"]
        assert logged["reward/metrics_flagged_length"] == pytest.approx(local[0]["reward/metrics_flagged_length"])
        reward_means = [rank["rollout/reward_mean"] for rank in local]
        assert logged["rollout/reward_mean"] == pytest.approx(sum(reward_means) / WORLD)
        for key in ("rollout/completion_length_max", "rollout/turns_max"):
            assert logged[key] == max(rank[key] for rank in local)


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    worker(Path(sys.argv[1]))
