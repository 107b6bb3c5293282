"""The run closes its environment (``Environment.close``: sessions, a server it started) when it ends, and when
it fails (Lightning runs no teardown after an error: the data module's ``on_exception``)."""

from __future__ import annotations

import pytest
from conftest import TINY, quiet_trainer

from grpo_lightning import GRPOModule, RolloutDataModule, SamplingConfig
from grpo_lightning.integrations.environments.base import Environment, Step


class Closing(Environment):
    closed = 0  # counted on the class: every trajectory's copy is a deep copy
    fail = False

    def reset(self, row):
        return None

    def step(self, turn):
        if Closing.fail:
            raise RuntimeError("the environment broke")
        return Step(observation=" ok", done=False)

    def close(self) -> None:
        Closing.closed += 1


def run(tmp_path) -> None:
    data = RolloutDataModule(
        sampling=SamplingConfig(group_size=2, max_new_tokens=6),
        prompts_per_round=2,
        val_split=None,
        environment=Closing(max_turns=2, max_turn_tokens=2),
    )
    quiet_trainer(tmp_path, max_epochs=1).fit(GRPOModule(tiny_model=TINY), datamodule=data)


def test_the_environment_is_closed_when_the_run_ends_and_when_it_fails(tmp_path):
    Closing.closed, Closing.fail = 0, False
    run(tmp_path / "ends")
    assert Closing.closed == 1
    Closing.closed, Closing.fail = 0, True
    with pytest.raises(RuntimeError, match="the environment broke"):
        run(tmp_path / "fails")
    assert Closing.closed >= 1
