"""Exact resume: a run stopped at a round boundary and resumed equals the uninterrupted run, tensor for tensor.

The recipe draws on every source of state a resume must restore: sampling (the DataModule's generator), a reward
that reads the global torch, numpy and python RNGs, the adaptive β of ``KLController``, a reference model moved by
``ReferenceSync``, AdamW moments, a warm-up schedule and the prompt stream.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import TINY
from lightning import Callback, Trainer, seed_everything

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.callbacks.checkpointing import RoundCheckpoint
from grpo_lightning.callbacks.kl import KLController, ReferenceSync
from grpo_lightning.callbacks.policy_sync import OldPolicySync
from grpo_lightning.checkpoint_io import AtomicCheckpointIO, remove_partial_checkpoints
from grpo_lightning.cli import TRAINER_DEFAULTS
from grpo_lightning.config import ConfigError, EvalConfig, ScheduleConfig, UpdateConfig
from grpo_lightning.config_checks import check_state_dict_shapes
from grpo_lightning.models.tiny import TinyModelConfig
from grpo_lightning.rewards import RewardError, RewardSpec, register

PROMPTS, GROUP = 2, 4
FAIL = {"round": None}  # set to a round number to make the reward below raise in that round's rollout


@register("resume_noisy_length")
def noisy_length(prompts, completions, **_):
    """The length, plus noise from all three global RNGs: any RNG state the resume misses changes the rewards."""
    if FAIL["round"] is not None and FAIL.get("calls", 0) + 1 == FAIL["round"]:
        raise ValueError("injected failure")
    FAIL["calls"] = FAIL.get("calls", 0) + 1
    return [float(len(c)) + random.random() + float(np.random.rand()) + float(torch.rand(())) for c in completions]


class Recorder(Callback):
    """Per round: the stream position after the rollout, its rewards and completions, β; per step: the loss."""

    def __init__(self) -> None:
        self.positions, self.rewards, self.completions, self.betas, self.losses = [], [], [], [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().clone())

    def on_train_epoch_end(self, trainer, module):
        rollout = trainer.datamodule.last_rollout  # this round's: drawn when its first batch was fetched
        self.positions.append(trainer.datamodule.position)
        self.rewards.append(rollout.rewards.clone())
        self.completions.append(list(rollout.completions))
        self.betas.append(module.beta)


def fit(dirpath, epochs, *, ckpt_path=None, every_n_rounds=1, tiny=TINY, engine="auto", rollout_lag=0, extra=()):
    """One in-process ``fit`` of the recipe; returns the module, datamodule and recorder (``test_vllm_runs.py``
    runs it with the vllm engine, ``test_async_rollouts.py`` at a rollout lag)."""
    seed_everything(0)
    FAIL["calls"] = 0
    module = GRPOModule(tiny_model=tiny, objective=ObjectiveConfig(beta=0.05), lr=1e-3, warmup_steps=3)
    data = RolloutDataModule(
        rewards=[RewardSpec("resume_noisy_length")],
        sampling=SamplingConfig(group_size=GROUP, max_new_tokens=4),
        engine=engine,
        schedule=ScheduleConfig(rollout_lag=rollout_lag),
        prompts_per_round=PROMPTS,
        update=UpdateConfig(mini_batch_size=4),
        eval=EvalConfig(limit=4),
        task_kwargs={"test_size": 50},
    )
    recorder = Recorder()
    callbacks = [recorder, KLController(target_kl=0.001, horizon=100), ReferenceSync(sync_steps=3, alpha=0.5)]
    callbacks.append(OldPolicySync())  # the CLI adds it; an engine with its own weights needs it
    callbacks.extend(extra)
    trainer = Trainer(
        **TRAINER_DEFAULTS,
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[*callbacks, RoundCheckpoint(dirpath=str(dirpath), every_n_rounds=every_n_rounds)],
        plugins=[AtomicCheckpointIO()],
        default_root_dir=dirpath,
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module, data, recorder


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: 6 rounds."""
    dirpath = tmp_path_factory.mktemp("reference")
    module, data, recorder = fit(dirpath, 6)
    return module, recorder, dirpath


def assert_same_run(reference, module, recorders):
    ref_module, ref = reference[0], reference[1]
    names = ("positions", "rewards", "completions", "betas", "losses")
    got = {name: [x for r in recorders for x in getattr(r, name)] for name in names}
    assert got["positions"] == ref.positions == [PROMPTS * (i + 1) for i in range(6)]  # no extra rollout drawn
    assert got["completions"] == ref.completions
    assert all(torch.equal(a, b) for a, b in zip(got["rewards"], ref.rewards, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got["losses"], ref.losses, strict=True))
    assert got["betas"] == ref.betas
    for name, value in ref_module.state_dict().items():  # policy and (synced) reference weights
        assert torch.equal(module.state_dict()[name], value), name
    assert module.trainer.global_step == ref_module.trainer.global_step


def test_three_rounds_then_three_more_equal_six_rounds(reference, tmp_path):
    _, _, first = fit(tmp_path, 3)
    module, data, second = fit(tmp_path, 6, ckpt_path="last")
    assert len(first.positions) == len(second.positions) == 3  # the resumed run did rounds 4-6 only
    assert_same_run(reference, module, [first, second])
    ref_optimizer = reference[0].trainer.optimizers[0].state_dict()["state"]
    optimizer = module.trainer.optimizers[0].state_dict()["state"]
    assert all(torch.equal(ref_optimizer[i]["exp_avg_sq"], s["exp_avg_sq"]) for i, s in optimizer.items())


def test_a_failed_rollout_leaves_a_checkpoint_of_the_last_round(reference, tmp_path):
    FAIL["round"] = 3  # the third rollout's reward call raises
    try:
        with pytest.raises(RewardError, match="resume_noisy_length"):
            fit(tmp_path, 6, every_n_rounds=5)  # no periodic save before the failure
    finally:
        FAIL["round"] = None
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert checkpoint["RolloutDataModule"]["position"] == 2 * PROMPTS  # round 3's draw is not kept
    assert checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] == 2
    module, _, resumed = fit(tmp_path, 6, ckpt_path="last")
    assert len(resumed.positions) == 4
    assert module.state_dict().keys() == reference[0].state_dict().keys()
    assert all(torch.equal(module.state_dict()[k], v) for k, v in reference[0].state_dict().items())


def test_a_checkpoint_of_another_model_is_refused_on_load(reference, tmp_path):
    other = TinyModelConfig(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32, max_position_embeddings=64)
    last = reference[2] / "last.ckpt"
    with pytest.raises(ConfigError, match="model.tiny_model"):
        fit(tmp_path, 7, ckpt_path=str(last), tiny=other)


def test_weights_of_another_shape_are_refused():
    expected = {"policy.model.embed_tokens.weight": torch.zeros(99, 32)}
    with pytest.raises(ConfigError, match=r"embed_tokens.weight has shape \[100, 32\]"):
        check_state_dict_shapes({"policy.model.embed_tokens.weight": torch.zeros(100, 32)}, expected, "'x.ckpt'")
    with pytest.raises(ConfigError, match="has no policy.model.embed_tokens.weight"):
        check_state_dict_shapes({"policy.other": torch.zeros(1)}, expected, "'x.ckpt'")


def test_atomic_write_keeps_the_previous_file_and_partial_files_are_ignored(tmp_path, monkeypatch):
    io, target = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"round": 1}, target)
    assert torch.load(target, weights_only=True) == {"round": 1}

    def fail_midway(obj, f, *args, **kwargs):
        f.write(b"partial bytes")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", fail_midway)
    with pytest.raises(OSError, match="disk full"):
        io.save_checkpoint({"round": 2}, target)
    monkeypatch.undo()
    assert torch.load(target, weights_only=True) == {"round": 1}  # the old file is intact, no temp file left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    # What a kill -9 mid-write leaves: never taken for a checkpoint, removed when the next fit starts.
    (tmp_path / ".last.ckpt.tmp-12345").write_bytes(b"partial")
    callback = RoundCheckpoint(dirpath=str(tmp_path))
    trainer = Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    assert callback._find_last_checkpoints(trainer) == {str(target)}
    assert [p.name for p in remove_partial_checkpoints(tmp_path)] == [".last.ckpt.tmp-12345"]


def test_a_round_is_drawn_only_when_its_first_batch_is_fetched(tmp_path):
    """Lightning builds a train loader it never iterates when it resumes at a round boundary: that costs nothing
    and draws no prompt (so no loop state has to be rewritten in checkpoints)."""
    seed_everything(0)
    module = GRPOModule(tiny_model=TINY, objective=ObjectiveConfig(beta=0.0))
    data = RolloutDataModule(
        rewards=[RewardSpec("resume_noisy_length")],
        sampling=SamplingConfig(group_size=GROUP, max_new_tokens=4),
        prompts_per_round=PROMPTS,
        val_split=None,
    )
    trainer = Trainer(**TRAINER_DEFAULTS, max_epochs=1, accelerator="cpu", logger=False, enable_progress_bar=False)
    trainer.fit(module, datamodule=data)
    assert data.position == PROMPTS
    unused = data.train_dataloader()
    assert len(unused) == 1 and data.position == PROMPTS and data.last_rollout is not None  # nothing drawn
    batch = next(iter(data.train_dataloader()))
    assert data.position == 2 * PROMPTS and batch["completion_ids"].size(0) == PROMPTS * GROUP
