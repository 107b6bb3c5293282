"""Partial rollouts in whole runs (``data.schedule.partial_rollouts``): the background process, the checkpoints.

With a budget per push that covers ``max_new_tokens`` no sequence spans a push, and the run trains on the very
tensors of ``rollout_lag: 1``. With a small budget every sequence of the tiny random model (it rarely ends before
``max_new_tokens``) spans several pushes, so checkpoints hold sequences in flight, decoded under several versions;
3 rounds, then 3 more from the checkpoint, equal 6 rounds, tensor for tensor; and a run killed (-9) in the middle
of a segment resumes to the weights of an uninterrupted one.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from conftest import TINY
from lightning import Callback, Trainer, seed_everything
from test_resume import GROUP, PROMPTS, Recorder

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.callbacks.checkpointing import RoundCheckpoint
from grpo_lightning.callbacks.kl import KLController
from grpo_lightning.checkpoint_io import AtomicCheckpointIO
from grpo_lightning.cli import TRAINER_DEFAULTS
from grpo_lightning.config import EvalConfig, ScheduleConfig, UpdateConfig
from grpo_lightning.rewards import RewardSpec

pytestmark = pytest.mark.slow  # whole runs with a background process each: the slow tier (`pytest -m slow`)

MAX_NEW = 8


class Metrics(Callback):
    """Every round's metrics of partial rollouts."""

    def __init__(self) -> None:
        self.rounds: list[dict[str, float]] = []

    def on_train_epoch_end(self, trainer, module):
        metrics = trainer.datamodule.last_rollout.metrics
        self.rounds.append({k: v for k, v in metrics.items() if k.startswith("rollout/") and "time" not in k})


def fit(dirpath, epochs, schedule: ScheduleConfig, *, ckpt_path=None):
    """``test_resume.fit``'s recipe (a reward reading every global RNG, adaptive β, AdamW) at ``schedule``."""
    seed_everything(0)
    module = GRPOModule(tiny_model=TINY, objective=ObjectiveConfig(beta=0.05), lr=1e-3, warmup_steps=3)
    data = RolloutDataModule(
        rewards=[RewardSpec("resume_noisy_length")],
        sampling=SamplingConfig(group_size=GROUP, max_new_tokens=MAX_NEW),
        schedule=schedule,
        prompts_per_round=PROMPTS,
        update=UpdateConfig(mini_batch_size=4),
        eval=EvalConfig(limit=4),
        task_kwargs={"test_size": 50},
    )
    recorder, metrics = Recorder(), Metrics()
    trainer = Trainer(
        **TRAINER_DEFAULTS,
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[
            recorder,
            metrics,
            KLController(target_kl=0.001, horizon=100),
            RoundCheckpoint(dirpath=str(dirpath)),
        ],
        plugins=[AtomicCheckpointIO()],
        default_root_dir=dirpath,
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module, recorder, metrics


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_budget_that_covers_max_new_tokens_trains_on_exactly_the_tensors_of_lag_1(tmp_path):
    lag_module, lag_run, _ = fit(tmp_path / "lag", 3, ScheduleConfig(rollout_lag=1))
    schedule = ScheduleConfig(rollout_lag=1, partial_rollouts=True, tokens_per_push=MAX_NEW)
    module, run, metrics = fit(tmp_path / "partial", 3, schedule)
    assert run.completions == lag_run.completions and same(run.rewards, lag_run.rewards)
    assert same(run.losses, lag_run.losses)
    for name, value in lag_module.state_dict().items():
        assert torch.equal(module.state_dict()[name], value), name
    assert all(m["rollout/interrupted_sequences"] == 0 and m["rollout/staleness_max"] <= 1 for m in metrics.rounds)


def test_three_rounds_then_three_more_equal_six_with_sequences_in_flight_across_the_checkpoint(tmp_path):
    schedule = ScheduleConfig(rollout_lag=1, partial_rollouts=True, tokens_per_push=2)
    reference, ref_run, ref_metrics = fit(tmp_path / "reference", 6, schedule)
    # Every sequence spans pushes: decoded under more than one version, and in flight at every round boundary.
    assert all(m["rollout/interrupted_sequences"] > 0 for m in ref_metrics.rounds)
    ages = [[a for a in range(5) if m[f"rollout/tokens_behind_{a}"]] for m in ref_metrics.rounds]
    assert sum(len(a) >= 2 for a in ages) >= 2, ages  # rounds whose tokens come from several versions
    _, first, first_metrics = fit(tmp_path / "run", 3, schedule)
    saved = torch.load(tmp_path / "run" / "last.ckpt", weights_only=True)
    (queue,) = next(v for k, v in saved.items() if "DataModule" in k)["background"]  # one rank's
    in_flight = [s for g in queue["pool"]["groups"] for s in g["samples"]]
    assert in_flight and all(0 < len(s["tokens"]) < MAX_NEW for s in in_flight)  # sequences in flight, saved
    module, second, second_metrics = fit(tmp_path / "run", 6, schedule, ckpt_path="last")
    assert first.completions + second.completions == ref_run.completions
    assert same(first.rewards + second.rewards, ref_run.rewards)
    assert same(first.losses + second.losses, ref_run.losses)
    assert first_metrics.rounds + second_metrics.rounds == ref_metrics.rounds
    for name, value in reference.state_dict().items():
        assert torch.equal(module.state_dict()[name], value), name


def test_clock_mode_trains_and_decodes_until_each_push(tmp_path):
    """``interrupt: clock``: not reproducible, so only what must hold: the run trains, every round is admitted
    within the staleness bound, and the background process ran at least one segment per push."""
    schedule = ScheduleConfig(rollout_lag=1, partial_rollouts=True, tokens_per_push=2, interrupt="clock")
    _, run, metrics = fit(tmp_path, 3, schedule)
    assert len(run.losses) and all(torch.isfinite(loss) for loss in run.losses)
    assert all(m["rollout/staleness_max"] <= schedule.max_staleness for m in metrics.rounds)
    assert all(m["rollout/segments"] >= 1 for m in metrics.rounds[1:])


# ------------------------------------------------------------------------------------------------ kill -9
PARTIAL = ("--data.schedule.partial_rollouts", "true", "--data.schedule.tokens_per_push", "2")


def test_kill_9_mid_segment_then_resume_equals_an_uninterrupted_run(tmp_path):
    """``test_async_kill.py``'s harness (the quickstart, 5 rounds, a checkpoint every round; a reward of weight 0
    that counts the worker's scoring calls and sleeps in the 5th) with partial rollouts, 2 tokens per push (the
    quickstart's 5-token completions span up to 3 pushes): kill -9 of the trainer in the middle of a segment, then
    ``--ckpt_path last``, ends with the weights of an uninterrupted run."""
    from test_async_kill import KILL_AT_CALL, LAST, alive, children, start, weights

    reference = start(tmp_path / "reference", *PARTIAL)
    run = start(tmp_path / "run", *PARTIAL, slow=3.0)
    calls = tmp_path / "run" / "calls.txt"
    while not (calls.exists() and len(calls.read_text().splitlines()) >= KILL_AT_CALL):
        assert run.poll() is None, run.communicate()[0][-3000:]
        time.sleep(0.2)
    workers = children(run.pid)
    os.kill(run.pid, signal.SIGKILL)
    run.communicate()
    assert workers, "no background process"
    time.sleep(2)
    assert not [w for w in workers if alive(w)], "the background process outlived the trainer"
    resumed = start(tmp_path / "run", *PARTIAL, "--ckpt_path", "last")
    for process in (resumed, reference):
        output, _ = process.communicate(timeout=600)
        assert process.returncode == 0, output[-3000:]
    final, expected = weights(tmp_path / "run" / LAST), weights(tmp_path / "reference" / LAST)
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in final)
