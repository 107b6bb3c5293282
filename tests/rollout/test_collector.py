"""The rollout collector (``rollout/collector.py``): a round reads like the algorithm and needs no callback.

An engine that holds its own copy of the weights (``CopyEngine``, a stand-in for vLLM: the lean sampling loop on a
copy that only ``load_weights`` refreshes) is trained with a plain ``Trainer`` and no callback at all: every round
and every evaluation samples from the current weights, and the round's steps come in the algorithm's order.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import TINY, quiet_trainer
from helpers import length_reward
from lightning import Callback, Trainer

from grpo_lightning import GRPOModule, ObjectiveConfig, RolloutDataModule, SamplingConfig
from grpo_lightning.callbacks.policy_sync import OldPolicySync
from grpo_lightning.cli import TRAINER_DEFAULTS
from grpo_lightning.config import ConfigError, EvalConfig, UpdateConfig
from grpo_lightning.engines.lean import LeanEngine
from grpo_lightning.modality import TEXT
from grpo_lightning.rewards import RewardSpec, register
from grpo_lightning.rollout.datamodule import latest_rollout

register("collector_length")(length_reward)


class CopyEngine(LeanEngine):
    """Samples from a copy of the policy that only ``load_weights`` refreshes; records what the round asks of it."""

    name = "copy"
    shares_weights = False

    def __init__(self) -> None:
        super().__init__()
        self.copy: torch.nn.Module | None = None
        self.events: list[tuple[str, int | None]] = []

    def setup(self, policy, tokenizer, modality=TEXT) -> None:
        super().setup(policy, tokenizer, modality)
        self.copy = copy.deepcopy(policy)

    def load_weights(self, policy, version: int) -> None:
        self.copy.load_state_dict(policy.state_dict())
        super().load_weights(policy, version)
        self.events.append(("push", version))

    def generate(self, prompt_ids, prompt_mask, params, *, generator=None, return_logprobs=False):
        self.events.append(("generate", self.weights_version))
        policy, self.policy = self.policy, self.copy  # the lean loop samples from ``self.policy``: the copy
        try:
            return super().generate(
                prompt_ids, prompt_mask, params, generator=generator, return_logprobs=return_logprobs
            )
        finally:
            self.policy = policy

    def offload(self) -> None:
        self.events.append(("offload", self.weights_version))


class Steps(Callback):
    """The optimizer step at each round's start and end."""

    def __init__(self) -> None:
        self.starts: list[int] = []

    def on_train_epoch_start(self, trainer, module) -> None:
        self.starts.append(trainer.global_step)


def make(engine, **data_settings):
    module = GRPOModule(tiny_model=TINY, objective=ObjectiveConfig(beta=0.0), lr=1e-2)
    data = RolloutDataModule(
        rewards=[RewardSpec("collector_length")],
        sampling=SamplingConfig(group_size=4, max_new_tokens=4),
        engine=engine,
        prompts_per_round=2,
        eval=EvalConfig(limit=4, batch_size=4),
        task_kwargs={"test_size": 20},
        **data_settings,
    )
    return module, data


def test_an_engine_with_its_own_weights_samples_the_current_policy_with_no_callback(tmp_path):
    engine, steps = CopyEngine(), Steps()
    module, data = make(engine, update=UpdateConfig(num_iterations=2))  # two optimizer steps a round: π_old recorded
    rounds = 3
    trainer = Trainer(
        **{**TRAINER_DEFAULTS, "check_val_every_n_epoch": 2, "num_sanity_val_steps": 0},
        max_epochs=rounds,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[steps],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=data)
    assert steps.starts == [0, 2, 4]
    # Each round: the push of the weights it starts from (none at step 0: the copy was taken then), generation
    # from them, then the generation memory released; the evaluation after round 2 pushes the weights of step 4.
    # Round 1 (step 0): the engine's copy is pushed the weights of step 0, generates, releases its memory; round 2
    # (step 2) likewise; the evaluation after round 2 pushes step 4's, and round 3 (step 4) then needs no push.
    assert engine.events == [
        ("push", 0), ("generate", 0), ("offload", 0),
        ("push", 2), ("generate", 2), ("offload", 2),
        ("push", 4), ("generate", 4),
        ("generate", 4), ("offload", 4),
    ]  # fmt: skip
    rollout = latest_rollout(trainer)
    assert rollout is data.last_rollout and rollout.old_logprobs is not None
    assert "time/weight_sync" in trainer.logged_metrics
    assert "val/accuracy" in trainer.logged_metrics


def test_a_round_runs_its_steps_in_the_algorithms_order(tmp_path, monkeypatch):
    """push → generate → score → advantages → log-probs → release → micro-batches, as ``collect`` reads."""
    import grpo_lightning.rollout.collector as collector_module

    order: list[str] = []

    def recorded(name, fn):
        def call(*args, **kwargs):
            order.append(name)
            return fn(*args, **kwargs)

        return call

    engine = CopyEngine()
    module, data = make(engine)
    monkeypatch.setattr(collector_module, "sample_round", recorded("sample", collector_module.sample_round))
    monkeypatch.setattr(collector_module, "finish_round", recorded("finish", collector_module.finish_round))
    trainer = quiet_trainer(tmp_path, max_epochs=1)
    module.optimizer_step = recorded("update", module.optimizer_step)
    engine.load_weights = recorded("push", engine.load_weights)
    engine.offload = recorded("release", engine.offload)
    trainer.fit(module, datamodule=data)
    assert order == ["push", "sample", "finish", "release", "update"]


def test_a_trainer_built_in_python_is_told_the_gradient_accumulation_its_batches_need(tmp_path):
    module, data = make("lean", update=UpdateConfig(mini_batch_size=8, micro_batch_size=2))
    trainer = quiet_trainer(tmp_path, max_epochs=1)
    message = (
        r"^trainer.accumulate_grad_batches = 1, but data.update.mini_batch_size / data.update.micro_batch_size = 4 "
        r"micro-batches "
        r"make an optimizer step: set Trainer\(accumulate_grad_batches=4\)"
    )
    with pytest.raises(ConfigError, match=message):
        trainer.fit(module, datamodule=data)
    assert trainer.accumulate_grad_batches == 1  # checked, never set by the data side
    module, data = make("lean", update=UpdateConfig(mini_batch_size=8, micro_batch_size=2))
    trainer = quiet_trainer(tmp_path, max_epochs=1, accumulate_grad_batches=4)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 1


def test_a_policy_side_that_gives_no_old_logprobs_stops_a_round_of_several_steps(tmp_path):
    module, data = make(
        "lean", update=UpdateConfig(num_iterations=2, old_logprobs="recompute")
    )  # π_old: the module's pass
    module.rollout_logprobs = lambda batch, *, old, ref: (None, None)
    with pytest.raises(RuntimeError, match=r"^round 1 has 2 optimizer steps but carries no π_old log-probs"):
        quiet_trainer(tmp_path, max_epochs=1).fit(module, datamodule=data)


def test_old_policy_sync_is_a_deprecated_no_op(tmp_path, caplog):
    with pytest.deprecated_call(match="OldPolicySync is no longer needed"):
        callback = OldPolicySync()
    module, data = make(CopyEngine())
    with caplog.at_level(logging.WARNING):
        quiet_trainer(tmp_path, max_epochs=1, callbacks=[callback]).fit(module, datamodule=data)
    assert data.engine.events[:2] == [("push", 0), ("generate", 0)]  # the round pushed: the callback did nothing


def test_a_stop_iteration_inside_a_round_stops_the_run_instead_of_ending_the_epoch_silently(tmp_path, monkeypatch):
    from grpo_lightning.rollout import collector

    def broken(*args, **kwargs):
        raise StopIteration("from inside a rollout step")

    monkeypatch.setattr(collector, "sample_round", broken)
    data = RolloutDataModule(sampling=SamplingConfig(group_size=2, max_new_tokens=4), prompts_per_round=2)
    with pytest.raises(RuntimeError, match="the round raised StopIteration"):
        quiet_trainer(tmp_path, max_epochs=1).fit(GRPOModule(tiny_model=TINY), datamodule=data)
