"""Crash safety: ``kill -9`` and SIGTERM at chosen moments of round 4, then ``--ckpt_path last``; the NaN guard.

Each interrupted ``fit`` is a process forked from this one (spawned when torch runs several threads), running the
real CLI (``grpo_lightning.cli.main``) on a YAML config; resumes and the uninterrupted reference run in this process. A
``Marker`` callback in the config writes what the run is doing to a file and, in the forked run only, slows round
4 down so that a signal lands in the intended phase.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import random
import signal
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import yaml
from conftest import TINY, quiet_trainer
from helpers import length_reward
from lightning import Callback, Trainer, seed_everything

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.checkpoint_io import AtomicCheckpointIO
from grpo_lightning.cli import main
from grpo_lightning.config import EvalConfig, UpdateConfig
from grpo_lightning.guard import NonFiniteError, NonFiniteGuard
from grpo_lightning.rewards import RewardSpec, register

ROUNDS, PROMPTS, STEPS_PER_ROUND = 5, 2, 2
SLOW_ENV = "GRPO_TEST_SLOW_ROUND"  # set in forked runs only: the round that Marker slows down ("4w": its save too)
WRITE_DELAY_ENV = "GRPO_TEST_WRITE_DELAY_S"  # set by Marker in a forked run: SlowWriteIO's pause mid-write


class SlowWriteIO(AtomicCheckpointIO):
    """The atomic writer, pausing once the bytes are written and before the rename when ``$GRPO_TEST_WRITE_DELAY_S``
    is set: a kill then lands in the middle of a checkpoint write."""

    def before_sync(self, tmp: Path) -> None:
        time.sleep(float(os.environ.get(WRITE_DELAY_ENV, "0") or 0))


register("crash_length")(length_reward)


class Marker(Callback):
    """Writes ``generate R``, ``step R S`` and ``save R`` lines; slows round ``$GRPO_TEST_SLOW_ROUND`` down."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def _mark(self, line: str) -> None:
        with open(self.path, "a") as f:
            f.write(line + "\n")

    @staticmethod
    def _slow(trainer: Trainer) -> bool:
        return os.environ.get(SLOW_ENV, "").rstrip("w") == str(trainer.current_epoch + 1)

    def on_fit_start(self, trainer, module):
        engine = trainer.datamodule.collector.current_engine()
        generate = engine.generate

        def marked_generate(*args, **kwargs):
            self._mark(f"generate {trainer.current_epoch + 1}")
            if self._slow(trainer):
                time.sleep(1.0)  # wide windows: the signal lands where intended even on a loaded machine
            return generate(*args, **kwargs)

        engine.generate = marked_generate

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self._mark(f"step {trainer.current_epoch + 1} {trainer.global_step}")
        if self._slow(trainer):
            time.sleep(0.5)

    def on_train_epoch_end(self, trainer, module):
        if self._slow(trainer) and os.environ[SLOW_ENV].endswith("w"):
            os.environ[WRITE_DELAY_ENV] = "3"  # the checkpoint of this round is written slowly (Marker runs first)
        self._mark(f"save {trainer.current_epoch + 1}")


def write_config(tmp: Path, every_n_rounds: int = 1) -> Path:
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "max_epochs": ROUNDS,
            "logger": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "limit_val_batches": 0,
            "default_root_dir": str(tmp),
            "plugins": [{"class_path": "test_crash.SlowWriteIO"}],
            "callbacks": [
                {
                    "class_path": "grpo_lightning.callbacks.checkpointing.RoundCheckpoint",
                    "init_args": {"dirpath": str(tmp / "ckpt"), "every_n_rounds": every_n_rounds},
                },
                {"class_path": "test_crash.Marker", "init_args": {"path": str(tmp / "markers")}},
            ],
        },
        "model": {"tiny_model": asdict(TINY), "objective": {"beta": 0.04}, "lr": 1e-3},
        "data": {
            "rewards": [{"name": "crash_length"}],
            "sampling": {"group_size": 4, "max_new_tokens": 4},
            "prompts_per_round": PROMPTS,
            "update": {"mini_batch_size": 4},
            "eval": {"limit": 4},
            "task_kwargs": {"test_size": 50},
        },
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _forked_fit(config: Path, slow: str) -> None:
    os.environ[SLOW_ENV] = slow
    main(["fit", "--config", str(config)])


def start_fit(config: Path, slow: str = "4") -> multiprocessing.Process:
    # Forking skips a second import of torch, but a child forked after OpenMP started a pool of several threads
    # deadlocks in its first parallel region (libgomp): with more than one intra-op thread, spawn instead.
    method = "fork" if torch.get_num_threads() == 1 else "spawn"
    process = multiprocessing.get_context(method).Process(target=_forked_fit, args=(config, slow))
    process.start()
    return process


# Bounds on a hang, not speed checks: generous, so that a loaded machine (a run 30× slower) still passes.
HANG_S = 600


def wait_for(process: multiprocessing.Process, markers: Path, line: str, timeout: float = HANG_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if markers.exists() and line in markers.read_text().splitlines():
            return
        if not process.is_alive():
            raise AssertionError(f"the run ended (exit code {process.exitcode}) before {line!r}")
        time.sleep(0.01)
    process.kill()
    raise AssertionError(f"no {line!r} within {timeout}s")


def final_state(tmp: Path) -> dict:
    checkpoint = torch.load(tmp / "ckpt" / "last.ckpt", weights_only=True)
    return {"weights": checkpoint["state_dict"], "position": checkpoint["RolloutDataModule"]["position"]}


def assert_same_final_state(tmp: Path, reference: dict) -> None:
    state = final_state(tmp)
    assert state["position"] == reference["position"] == ROUNDS * PROMPTS
    assert state["weights"].keys() == reference["weights"].keys()
    assert all(torch.equal(v, reference["weights"][k]) for k, v in state["weights"].items())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted run, through the same CLI and config."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    main(["fit", "--config", str(write_config(tmp))])
    return final_state(tmp)


# The moments of round 4 (rounds take 2 optimizer steps: steps 7 and 8): (marker line, delay after it).
KILL_MOMENTS = {
    "generation": ("generate 4", 0.1),
    "between_steps": ("step 4 7", 0.05),
    "checkpoint_write": ("save 4", 0.5),
    "random_a": ("generate 4", random.Random(41).uniform(0.0, 2.0)),
    "random_b": ("generate 4", random.Random(42).uniform(0.0, 2.0)),
}


@pytest.mark.parametrize("moment", list(KILL_MOMENTS))
def test_kill_9_in_round_4_then_resume_last_ends_like_an_uninterrupted_run(reference, tmp_path, moment):
    config = write_config(tmp_path)
    line, delay = KILL_MOMENTS[moment]
    process = start_fit(config, "4w" if moment == "checkpoint_write" else "4")
    wait_for(process, tmp_path / "markers", line)
    time.sleep(delay)
    os.kill(process.pid, signal.SIGKILL)
    process.join()
    assert process.exitcode == -signal.SIGKILL
    partial = [p.name for p in (tmp_path / "ckpt").glob(".*.tmp-*")]
    if moment == "checkpoint_write":
        assert partial, "the kill was to land while a checkpoint was being written"
    main(["fit", "--config", str(config), "--ckpt_path", "last"])
    assert not list((tmp_path / "ckpt").glob(".*.tmp-*"))  # what the killed write left is cleaned up
    assert_same_final_state(tmp_path, reference)


@pytest.mark.parametrize("phase", ["generation", "update"])
def test_sigterm_saves_the_last_completed_round_and_resume_continues_from_it(reference, tmp_path, phase):
    config = write_config(tmp_path, every_n_rounds=2)  # so that round 3 has no periodic checkpoint
    process = start_fit(config)
    wait_for(process, tmp_path / "markers", "generate 4" if phase == "generation" else "step 4 7")
    time.sleep(0.05)
    os.kill(process.pid, signal.SIGTERM)
    process.join(timeout=HANG_S)
    assert process.exitcode == 0
    markers = (tmp_path / "markers").read_text().splitlines()
    saved = final_state(tmp_path)
    if phase == "generation":  # the rollout is abandoned at once: round 3 is the last completed one
        assert "step 4 7" not in markers and saved["position"] == 3 * PROMPTS
    else:  # the round in progress finishes first, then it is saved
        assert "step 4 8" in markers and "generate 5" not in markers and saved["position"] == 4 * PROMPTS
    main(["fit", "--config", str(config), "--ckpt_path", "last"])
    assert_same_final_state(tmp_path, reference)


# ------------------------------------------------------------------------------------------ non-finite guard
class Inject(Callback):
    """At the given optimizer steps, makes ``key`` of the batch NaN (or every gradient Inf, key ``grad``); records
    the policy's weights around every step."""

    def __init__(self, steps: set[int], key: str) -> None:
        self.steps, self.key = steps, key
        self.before, self.after, self._hooks = {}, {}, []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        step = trainer.global_step
        self.before[step] = {k: v.clone() for k, v in module.policy.state_dict().items()}
        if step in self.steps and self.key == "grad":
            first = next(module.policy.parameters())  # the (tied) embedding
            self._hooks = [first.register_hook(lambda g: g * float("inf"))]
        elif step in self.steps:
            batch[self.key][0] = float("nan")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.after[trainer.global_step - 1] = {k: v.clone() for k, v in module.policy.state_dict().items()}
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def guarded_fit(tmp_path, inject: Inject, max_skips: int = 3) -> Trainer:
    seed_everything(0)
    module = GRPOModule(
        tiny_model=TINY, objective=ObjectiveConfig(beta=0.04), lr=1e-3, warmup_steps=4, max_nonfinite_skips=max_skips
    )
    data = RolloutDataModule(
        rewards=[RewardSpec("crash_length")],
        sampling=SamplingConfig(group_size=4, max_new_tokens=4),
        prompts_per_round=PROMPTS,
        update=UpdateConfig(mini_batch_size=4),
        eval=EvalConfig(limit=4),
        task_kwargs={"test_size": 50},
    )
    trainer = quiet_trainer(tmp_path, max_epochs=2, callbacks=[inject])
    trainer.fit(module, datamodule=data)
    return trainer


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(v, b[k]) for k, v in a.items())


@pytest.mark.parametrize(
    "key,culprit",
    [("advantages", "advantages (from the rewards)"), ("grad", "gradients of policy.model.embed_tokens.weight")],
)
def test_a_non_finite_step_is_skipped_and_training_continues(tmp_path, caplog, key, culprit):
    inject = Inject({1}, key)
    with caplog.at_level(logging.WARNING, logger="grpo_lightning"):
        trainer = guarded_fit(tmp_path, inject)
    assert same(inject.before[1], inject.after[1])  # the NaN step left every weight as it was
    assert not same(inject.after[1], inject.after[3])  # and training went on
    assert trainer.global_step == 2 * STEPS_PER_ROUND
    # Nor did it touch AdamW's state: 3 updates counted for 4 steps.
    assert {float(s["step"]) for s in trainer.optimizers[0].state.values()} == {3.0}
    assert f"round 1, optimizer step 1: non-finite {culprit}" in caplog.text
    # The skipped step did not advance the warm-up either: 3 scheduler steps for 3 updates.
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 3
    assert trainer.lightning_module.nonfinite.total == 1


def test_the_guard_names_culprits_only_for_non_finite_losses_at_step_time():
    """Losses are queued (no device sync per micro-batch); culprits are looked for only when one was not finite."""
    guard = NonFiniteGuard()
    grad = torch.nn.Parameter(torch.ones(2))
    grad.grad = torch.ones(2)

    def never() -> list[list[str]]:
        raise AssertionError("culprits looked for although the loss was finite")

    guard.check_later(torch.tensor(1.0), never)
    assert guard.should_skip(guard.check_pending([("w", grad)])) == []
    guard.check_later(torch.tensor(1.0), never)
    guard.check_later(torch.tensor(float("nan")), lambda: [[], ["advantages"], ["loss"]])  # first non-empty stage
    assert guard.should_skip(guard.check_pending([("w", grad)])) == ["advantages"]
    grad.grad = torch.tensor([1.0, float("inf")])
    guard.check_later(torch.tensor(1.0), never)
    assert guard.should_skip(guard.check_pending([("w", grad)])) == ["gradients of w (the loss was finite)"]
    assert guard._pending == []
    # A fit stopped inside an accumulation window: its queued NaN must not skip the next fit's first step.
    guard.check_later(torch.tensor(float("nan")), lambda: [["advantages"]])
    guard.clear_pending()
    grad.grad = torch.ones(2)
    assert guard.should_skip(guard.check_pending([("w", grad)])) == []


def test_consecutive_non_finite_steps_stop_the_run_with_the_culprit(tmp_path):
    inject = Inject({1, 2, 3}, "ref_logprobs")
    with pytest.raises(NonFiniteError, match=r"2 optimizer steps in a row .*reference log-probs \(the KL term\)"):
        guarded_fit(tmp_path, inject, max_skips=2)
    assert same(inject.after[0], inject.before[2])  # nothing changed after the last good step


def test_the_cli_reports_a_run_stopped_by_non_finite_values_in_one_line(tmp_path, capsys):
    config = write_config(tmp_path)
    args = ["fit", "--config", str(config), "--model.max_nonfinite_skips", "1", "--trainer.max_epochs", "1"]
    args += ["--trainer.callbacks+", "test_crash.Inject", "--trainer.callbacks.steps", "[0]"]
    args += ["--trainer.callbacks.key", "advantages"]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: 1 optimizer step in a row had non-finite values (last: round 1, step 0: advantages (from the "
        "rewards)); stopped so that no NaN reaches the weights. Raise model.max_nonfinite_skips to tolerate more, "
        "or lower model.lr"
    ]
