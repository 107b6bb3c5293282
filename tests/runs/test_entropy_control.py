"""Entropy control in whole runs: the adaptive coefficient holds the entropy near its target where a run without it
collapses, moves once per optimizer step by the rule, is logged, and a resumed run continues it exactly; the
top-entropy-quantile mask keeps its fraction of the tokens.

The tiny model starts near the entropy of a uniform choice (4.59 nats); at learning rate 0.05 the length reward
drives it down to below 1 nat in 12 rounds without a bonus.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TINY, quiet_trainer
from helpers import length_reward
from lightning import Callback, Trainer, seed_everything

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.callbacks.checkpointing import RoundCheckpoint
from grpo_lightning.checkpoint_io import AtomicCheckpointIO
from grpo_lightning.cli import TRAINER_DEFAULTS
from grpo_lightning.config import UpdateConfig
from grpo_lightning.rewards import RewardSpec, register

register("entropy_control_length")(length_reward)
TARGET, DELTA = 4.0, 0.5
ADAPTIVE = dict(use_adaptive_entropy=True, entropy_coef=0.0, entropy_coef_delta=DELTA, entropy_coef_max=5.0,
                entropy_target=TARGET)  # fmt: skip


class Steps(Callback):
    """Per optimizer step: the coefficient after it, the entropy it measured, the logged ``train/`` values."""

    def __init__(self) -> None:
        self.coefs, self.measured, self.entropies, self.logged, self._step = [], [], [], [], 0

    def on_train_start(self, trainer, module):
        self._step = trainer.global_step  # a resumed run's steps so far

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self._step:  # inside an accumulation window
            return
        self._step = trainer.global_step
        metrics = trainer.callback_metrics
        self.coefs.append(module.entropy_control.coef)
        self.measured.append(module.entropy_control.last_entropy)
        self.entropies.append(float(metrics["train/entropy"]))
        self.logged.append({k: float(v) for k, v in metrics.items() if k.startswith("train/")})


def data(**settings) -> RolloutDataModule:
    return RolloutDataModule(
        rewards=[RewardSpec("entropy_control_length")],
        sampling=SamplingConfig(group_size=4, max_new_tokens=6),
        prompts_per_round=2,
        val_split=None,
        **{"update": UpdateConfig(mini_batch_size=4), **settings},
    )


def fit(rounds: int, tmp_path, **objective) -> tuple[GRPOModule, Steps]:
    seed_everything(0)
    module = GRPOModule(tiny_model=TINY, objective=ObjectiveConfig(beta=0.0, **objective), lr=0.05)
    steps = Steps()
    quiet_trainer(tmp_path, max_epochs=rounds, callbacks=[steps]).fit(module, datamodule=data())
    return module, steps


def test_the_adaptive_coefficient_holds_the_entropy_near_its_target(tmp_path):
    _, plain = fit(12, tmp_path)
    module, adaptive = fit(12, tmp_path, **ADAPTIVE)
    assert plain.entropies[0] == pytest.approx(adaptive.entropies[0]) and adaptive.entropies[0] > TARGET + 0.4
    assert max(plain.entropies[-4:]) < TARGET - 1.5  # collapsed without the bonus
    first_below = next(i for i, h in enumerate(adaptive.entropies) if h <= TARGET)
    assert min(adaptive.entropies[first_below:]) > TARGET - 0.5  # the bonus brings it back each time
    assert sum(adaptive.entropies[-4:]) / 4 > TARGET - 0.3
    # The rule, step by step: the step's entropy (all tokens here) at or below the target moves c up, else down.
    previous = 0.0
    for coef, measured, entropy in zip(adaptive.coefs, adaptive.measured, adaptive.entropies):
        assert measured == pytest.approx(entropy, abs=1e-6)
        assert coef == pytest.approx(min(previous + DELTA, 5.0) if measured <= TARGET else max(previous - DELTA, 0.0))
        previous = coef
    assert max(adaptive.coefs) >= 2 * DELTA and adaptive.coefs[-1] == module.entropy_control.coef
    assert [row["train/entropy_coef"] for row in adaptive.logged] == pytest.approx(adaptive.coefs)
    assert "train/entropy_coef" not in plain.logged[-1]  # no bonus, nothing to log


def resumable_fit(rounds: int, dirpath, ckpt_path=None) -> tuple[GRPOModule, Steps]:
    """Adaptive, with the quantile mask, two micro-batches per optimizer step; a checkpoint every round."""
    seed_everything(0)
    objective = ObjectiveConfig(beta=0.0, top_entropy_quantile=0.5, **ADAPTIVE)
    module = GRPOModule(tiny_model=TINY, objective=objective, lr=0.05)
    steps = Steps()
    trainer = Trainer(
        **TRAINER_DEFAULTS,
        max_epochs=rounds,
        accelerator="cpu",
        accumulate_grad_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[steps, RoundCheckpoint(dirpath=str(dirpath), every_n_rounds=1)],
        plugins=[AtomicCheckpointIO()],
        default_root_dir=dirpath,
    )
    trainer.fit(
        module, datamodule=data(update=UpdateConfig(mini_batch_size=4, micro_batch_size=2)), ckpt_path=ckpt_path
    )
    return module, steps


def test_a_resumed_run_continues_the_coefficient_exactly(tmp_path):
    reference, whole = resumable_fit(8, tmp_path / "whole")
    assert len(set(whole.coefs)) > 2  # it moved, up and down
    assert all(0.3 < row["train/top_entropy_frac"] <= 0.7 for row in whole.logged)
    _, first = resumable_fit(4, tmp_path / "split")
    checkpoint = torch.load(tmp_path / "split" / "last.ckpt", weights_only=True)
    assert checkpoint["entropy_coef"] == {"coef": first.coefs[-1], "last_entropy": first.measured[-1]}
    module, second = resumable_fit(8, tmp_path / "split", ckpt_path="last")
    assert len(first.coefs) == len(second.coefs) == len(whole.coefs) / 2
    assert first.coefs + second.coefs == whole.coefs
    assert first.measured + second.measured == whole.measured
    assert all(math.isfinite(h) for h in whole.measured)
    for name, value in reference.state_dict().items():
        assert torch.equal(module.state_dict()[name], value), name
